// api.cu: the one symbol the host looks up: the table of entry points
// (host/tensor/cuda_api.h), refused when the host expects another ABI version.
#include "common.cuh"

extern "C" {
int rhc_device_count(int *n);
int rhc_device_name(int dev, char *buf, size_t len);
int rhc_device_limits(int dev, double *peak_gbps, int *sm_count);
int rhc_memstats(int dev, rhc_memstats_t *out);
int rhc_empty_cache(int dev);
int rhc_h2d(int dev, void *dst, const void *src, size_t n);
int rhc_d2d(int dst_dev, void *dst, int src_dev, const void *src, size_t n);
int rhc_cast(int, int, int, int, const int64_t *, void *, const int64_t *, const void *, const int64_t *);
int rhc_fill(int, int, int, const int64_t *, void *, const int64_t *, double);
int rhc_binary(int, int, int, int, const int64_t *, void *, const int64_t *, const void *, const int64_t *,
               const void *, const int64_t *);
int rhc_unary(int, int, int, int, const int64_t *, void *, const int64_t *, const void *, const int64_t *);
int rhc_any_negative_i64(int dev, const int64_t *a, int64_t n, int *out);
int rhc_reduce_rows(int, int, int, int, int64_t, int64_t, const void *, void *);
int rhc_softmax_rows(int, int, int, int64_t, int64_t, const void *, void *);
int rhc_gemm(int, int, int, int, int64_t, int64_t, int64_t, const void *, int64_t, int64_t, const void *, int64_t,
             int64_t, void *, int64_t, int64_t);
int rhc_nccl_available(char *why, size_t len);
int rhc_nccl_unique_id(void *id128);
int rhc_nccl_init(int dev, int nranks, int rank, const void *id128, void **comm);
int rhc_nccl_ready(void *comm);
int rhc_nccl_abort(void *comm);
int rhc_nccl_all_reduce(void *, const void *, void *, int64_t, int, int);
int rhc_nccl_broadcast(void *, void *, int64_t, int, int);
int rhc_nccl_reduce(void *, const void *, void *, int64_t, int, int, int);
int rhc_nccl_all_gather(void *, const void *, void *, int64_t, int);
int rhc_nccl_reduce_scatter(void *, const void *, void *, int64_t, int, int);
int rhc_nccl_send(void *, const void *, int64_t, int, int);
int rhc_nccl_recv(void *, void *, int64_t, int, int);
int rhc_nccl_group_start(void);
int rhc_nccl_group_end(void);
int rhc_event_record(int dev, void **event);
int rhc_event_done(void *event);
void rhc_event_free(void *event);
int rhc_index_select(int, int, int64_t, int64_t, int64_t, const void *, const int64_t *, int64_t, void *);
int rhc_gather_scatter(int, int, int, int, int, const int64_t *, const int64_t *, void *, const int64_t *, void *,
                       const int64_t *, double);
int rhc_masked_fill(int, int, int, const int64_t *, void *, const int64_t *, const void *, const int64_t *,
                    const void *, const int64_t *, double);
int rhc_mask_scan(int, int64_t, const void *, int64_t *, int64_t *);
int rhc_mask_compact(int, int, int64_t, const void *, const int64_t *, const void *, void *);
int rhc_mask_expand(int, int, int64_t, const void *, const int64_t *, const void *, void *);
int rhc_nonzero_write(int, int64_t, int, const int64_t *, const void *, const int64_t *, int64_t *, int64_t);
int rhc_sort_rows(int, int, int, int64_t, int64_t, const void *, void *, int64_t *, int64_t);
int rhc_scan_rows(int, int, int, int, int64_t, int64_t, const void *, void *);
int rhc_nn_im2col(int, int, const rhc_window_t *, int64_t, void *, void *, int);
int rhc_nn_pool(int, int, int, const rhc_window_t *, const void *, void *, int64_t *);
int rhc_nn_batch_norm(int, int, int64_t, int64_t, int64_t, const void *, const void *, const void *, void *, void *,
                      int, double, double, void *, double *, double *);
int rhc_nn_batch_norm_backward(int, int, int64_t, int64_t, int64_t, const void *, const void *, const void *,
                               const double *, const double *, int, void *, void *, void *);
int rhc_nn_layer_norm(int, int, int64_t, int64_t, const void *, const void *, const void *, double, void *, double *,
                      double *);
int rhc_nn_layer_norm_backward(int, int, int64_t, int64_t, const void *, const void *, const void *, const double *,
                               const double *, void *, void *, void *);
int rhc_nn_softmax_backward(int, int, int, int64_t, int64_t, const void *, const void *, void *);
int rhc_nn_lstm_cell(int, int, int64_t, int64_t, const void *, const void *, void *, void *, void *);
int rhc_nn_lstm_cell_backward(int, int, int64_t, int64_t, const void *, const void *, const void *, const void *,
                              void *, void *);
int rhc_bench_cublas_gemm(int dev, int n, int iters, double *ms);

static const char *api_last_error(void) { return rhc::last_error(); }

static const rhc_api_t api = {
    RHC_ABI_VERSION,
    api_last_error,
    rhc_device_count,
    rhc_device_name,
    rhc_synchronize,
    rhc_device_limits,
    rhc_alloc,
    rhc_free,
    rhc_memstats,
    rhc_empty_cache,
    rhc_h2d,
    rhc_d2h,
    rhc_d2d,
    rhc_cast,
    rhc_fill,
    rhc_binary,
    rhc_unary,
    rhc_any_negative_i64,
    rhc_reduce_rows,
    rhc_softmax_rows,
    rhc_gemm,
    rhc_nccl_available,
    rhc_nccl_unique_id,
    rhc_nccl_init,
    rhc_nccl_ready,
    rhc_nccl_abort,
    rhc_nccl_all_reduce,
    rhc_nccl_broadcast,
    rhc_nccl_reduce,
    rhc_nccl_all_gather,
    rhc_nccl_reduce_scatter,
    rhc_nccl_send,
    rhc_nccl_recv,
    rhc_nccl_group_start,
    rhc_nccl_group_end,
    rhc_event_record,
    rhc_event_done,
    rhc_event_free,
    rhc_index_select,
    rhc_gather_scatter,
    rhc_masked_fill,
    rhc_mask_scan,
    rhc_mask_compact,
    rhc_mask_expand,
    rhc_nonzero_write,
    rhc_sort_rows,
    rhc_scan_rows,
    rhc_nn_im2col,
    rhc_nn_pool,
    rhc_nn_batch_norm,
    rhc_nn_batch_norm_backward,
    rhc_nn_layer_norm,
    rhc_nn_layer_norm_backward,
    rhc_nn_softmax_backward,
    rhc_nn_lstm_cell,
    rhc_nn_lstm_cell_backward,
    rhc_bench_cublas_gemm,
};

__attribute__((visibility("default"))) const rhc_api_t *rhc_get_api(int abi_version) {
  return abi_version == RHC_ABI_VERSION ? &api : nullptr;
}

}  // extern "C"
