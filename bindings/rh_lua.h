/* rh_lua.h: the binding layer's shared pieces: the one per-process context and
 * the helpers every bound type uses to call back into Lua safely. */
#ifndef RH_LUA_H
#define RH_LUA_H

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <uv.h>

#include "net/conn.h"

/* The only mutable process-wide state: one per rpchost process. */
typedef struct {
  lua_State *L; /* the main thread; C callbacks run Lua on it, never on a coroutine */
  uv_loop_t *loop;
  rh_net_t net;
  int ref_traceback;         /* debug.traceback, the message handler for callbacks */
  uv_timer_t deadline_timer; /* armed for the scheduler's earliest deadline */
  int deadline_ref;          /* the Lua function it calls */
  int timer_ready;
  int ref_enc_hook, ref_dec_hook; /* the codec's hooks for non-plain values */
} rh_ctx_t;

rh_ctx_t *rh_ctx(void);

/* Calls the function below nargs arguments on ctx->L with a traceback handler.
 * A Lua error in a callback is printed (it is a bug in the library, not user
 * input) and the process goes on. Returns 0 on success. Pops function and args. */
int rh_callback(int nargs, int nresults);

/* Pushes a registry reference (LUA_NOREF pushes nil). */
void rh_pushref(lua_State *L, int ref);
void rh_unref(lua_State *L, int *ref);

/* Registers the metatable of a bound type: `methods` (may be NULL) as its
 * __index, and __gc / __tostring when given. The stack is left as it was. */
void rh_lua_class(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction gc, lua_CFunction tostring);

/* Raises a Lua error "what: <message for code>". */
int rh_error_code(lua_State *L, const char *what, int code);
/* Pushes true, or nil and the message of a failed rc (an RH_E* or libuv code);
 * returns how many it pushed: the "true | nil, message" answer of a binding. */
int rh_lua_push_rc(lua_State *L, int rc);

/* Module openers, one per bound type. */
int rh_open_loop(lua_State *L);
int rh_open_conn(lua_State *L);
int rh_open_proc(lua_State *L);
int rh_open_codec(lua_State *L);
int rh_open_tensor(lua_State *L);
int rh_open_tensor_ops(lua_State *L);
int rh_open_nn(lua_State *L);
int rh_open_cuda(lua_State *L);
int rh_open_crypto(lua_State *L);
int rh_open_repl(lua_State *L);
int rh_open_shm(lua_State *L);
int rh_open_cma(lua_State *L);
int rh_open_mpi(lua_State *L);
int rh_open_munge(lua_State *L);
int rh_open_arena(lua_State *L);
int rh_open_generator(lua_State *L);
int rh_open_atomic_file(lua_State *L);
int rh_open_body(lua_State *L);

/* A received frame's body lent to Lua during its callback (l_body.c): pushes a
 * lend of p[0..len) (1), or a string of them where lends run out (0); a pushed
 * lend is ended by rh_lua_endbody once the callback returns. rh_lua_tobody
 * reads a string or a live lend at i (NULL: neither; an ended lend raises). */
int rh_lua_pushbody(lua_State *L, const uint8_t *p, size_t len);
void rh_lua_endbody(lua_State *L);
const char *rh_lua_tobody(lua_State *L, int i, size_t *len);

/* Clocks for LuaJIT's FFI (lua/rpchost/sched.lua, rpc.lua), in seconds, read
 * without a lua_CFunction (which would end the compiled trace) and under names
 * of rpchost's own: declaring libc's clock_gettime with a struct of ours would
 * fix its type for every script in the process. (l_loop.c) */
double rh_clock_coarse(void); /* CLOCK_MONOTONIC_COARSE: the kernel's tick, a few ms */
double rh_clock_wall(void);   /* CLOCK_REALTIME */

/* tensors (l_tensor.c) */
struct rh_tensor_s;
struct rh_tensor_s *rh_lua_totensor(lua_State *L, int i); /* NULL if not a tensor */
struct rh_tensor_s *rh_lua_checktensor(lua_State *L, int i);
/* A dtype id at index i, and sizes from a Lua sequence at index i (at most
 * RH_MAXDIM whole numbers below 2^62 in magnitude: a hostile size from a
 * script or the network is refused before it becomes an integer). */
int rh_lua_checkdtype(lua_State *L, int i);
int rh_lua_checksizes(lua_State *L, int i, int64_t *size);
/* A device number at index i: -1 (the CPU) or a CUDA device index, a whole
 * number that fits an int, else an error naming it (a device from a script or
 * the network is refused before it becomes an int). Whether that device exists
 * here is the tensor core's check. optdevice: nil or none is the CPU. */
int rh_lua_checkdevice(lua_State *L, int i);
int rh_lua_optdevice(lua_State *L, int i);
/* a tensor whose bytes the host may touch: on a device it is an error naming `what` */
struct rh_tensor_s *rh_lua_checkhosttensor(lua_State *L, int i, const char *what);
/* a tensor whose bytes are one span of host memory (what the byte movers,
 * shm, CMA, the arena and MPI, copy from or into), and that span's length in
 * *nbytes (may be NULL); on a device or strided it is an error naming `what` */
struct rh_tensor_s *rh_lua_checkhostspan(lua_State *L, int i, const char *what, size_t *nbytes);
int rh_lua_pushtensor(lua_State *L, struct rh_tensor_s *t); /* takes the reference */
/* For LuaJIT's FFI (hot paths where a lua_CFunction would end the compiled
 * trace): the tensor a tensor userdata's block holds (the FFI passes a
 * userdata to a void * as its block), NULL once freed. The caller has checked
 * that the userdata is a tensor (its metatable is core.t_metatable()). */
struct rh_tensor_s *rh_lua_boxed_tensor(void *box);
/* What lua/rpchost/tensor/facts.lua reads of a tensor, through the FFI. */
typedef struct {
  int32_t dtype, device, contiguous, ndim;
  double numel, nbytes;
} rh_tensor_facts_t;
/* 0, or -1 for a freed tensor (box as for rh_lua_boxed_tensor) */
int rh_tensor_ffi_facts(void *box, rh_tensor_facts_t *out);
/* The same for a segment of a received frame: t_reinterpret of it hands its
 * tensor on to the result and leaves it freed (no other value shares those bytes). */
int rh_lua_pushframetensor(lua_State *L, struct rh_tensor_s *t);

/* For the codec's own path for tensors (l_codec.c), which skips its Lua hook:
 * plaintensor is the tensor at i when it travels as its dtype, sizes and bytes
 * (live, in host memory, contiguous), with *requires_grad whether its autograd
 * state says it requires gradients (1 only for exactly true; the rest of the
 * state never travels), else NULL and the hook decides; setrequiresgrad makes
 * the stateless float tensor at i a leaf that requires gradients (0, untouched,
 * for any other: the hook's path then says what is wrong); pushsegmenttensor
 * pushes the tensor the received segment at `seg` carries as dtype dt and n
 * sizes (t_reinterpret: its checks, its errors; dt a valid id, the sizes below
 * 2^62); become: a frame's segment that nothing else holds is retyped in place
 * and pushed itself, rather than viewed by a new tensor (the codec's decoder,
 * which holds the only reference). */
struct rh_tensor_s *rh_lua_plaintensor(lua_State *L, int i, int *requires_grad);
int rh_lua_setrequiresgrad(lua_State *L, int i);
int rh_lua_pushsegmenttensor(lua_State *L, int seg, int dt, int n, const int64_t *size, int become);

/* random generators (l_generator.c): the one at index i, NULL for nil or none
 * (the default generator) */
struct rh_rng_s;
struct rh_rng_s *rh_lua_optgenerator(lua_State *L, int i);

/* shared-memory segments (l_shm.c) */
#include "net/shm.h"
rh_shm_t *rh_lua_checkshm(lua_State *L, int i);
void rh_lua_pushshm(lua_State *L, rh_shm_t *s); /* takes the reference */

#endif
