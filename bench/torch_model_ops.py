#!/usr/bin/python3
"""bench/torch_model_ops.py: the PyTorch (CPU) side of bench/model_ops.lua, same keys.

Per-op overhead (add of 16 elements, us), memcpy and contiguous() of a permuted
64 MiB float32 tensor (GB/s, bytes read + written), cat of 8 x 8 MiB, index_select
and gather over 16M elements, sort of 16M float32, and a small MLP training loop
(steps/s, RSS at the start, half way and the end, peak RSS). Indices here are
0-based (PyTorch's); the rpchost side draws 1-based ones of the same distribution.

usage: /usr/bin/python3 bench/torch_model_ops.py [STEPS] [REPS]
output: "RESULT <key> <value>" lines.
"""
import ctypes
import sys
import time


def rss_mib(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv):
    import torch
    steps = int(argv[0]) if argv else 10000
    reps = int(argv[1]) if len(argv) > 1 else 5
    now = time.perf_counter

    def result(k, v):
        print(f"RESULT {k} {v}", flush=True)

    def best(fn, n=None):
        fn()
        b = float("inf")
        for _ in range(n or reps):
            t0 = now()
            r = fn()
            b = min(b, now() - t0)
            del r
        return b

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    xb = torch.randn(32, 64)
    yb = torch.randint(0, 10, (32,))

    def step():
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
    for _ in range(100):
        step()
    rss0 = rss_mib()
    half = rss0
    t0 = now()
    for i in range(1, steps + 1):
        step()
        if i == steps // 2:
            half = rss_mib()
    dt = now() - t0
    result("mlp_steps_per_s", f"{steps / dt:.1f}")
    result("mlp_rss_start_mib", f"{rss0:.1f}")
    result("mlp_rss_half_mib", f"{half:.1f}")
    result("mlp_rss_end_mib", f"{rss_mib():.1f}")
    a, b = torch.rand(16), torch.rand(16)
    n = 20000

    def adds():
        for _ in range(n):
            a + b
    result("add16_us", f"{best(adds, 3) / n * 1e6:.3f}")
    w = torch.rand(16, requires_grad=True)

    def recorded():
        for _ in range(n):
            w * b
    result("mul16_grad_us", f"{best(recorded, 3) / n * 1e6:.3f}")

    mb64 = 64 * 1024 * 1024
    src, dst = ctypes.create_string_buffer(b"\1" * mb64, mb64), ctypes.create_string_buffer(mb64)
    result("memcpy_gbs", f"{2 * mb64 / best(lambda: ctypes.memmove(dst, src, mb64)) / 1e9:.3f}")
    del src, dst
    x = torch.rand(4096, 4096)
    result("transpose64_gbs", f"{2 * mb64 / best(lambda: x.t().contiguous()) / 1e9:.3f}")
    y = x.view(64, 256, 1024).permute(2, 0, 1)
    result("permute64_gbs", f"{2 * mb64 / best(lambda: y.contiguous()) / 1e9:.3f}")
    result("clone64_gbs", f"{2 * mb64 / best(lambda: x.clone()) / 1e9:.3f}")
    del x, y

    parts = [torch.rand(2048, 1024) for _ in range(8)]
    result("cat_gbs", f"{2 * 8 * 8 * 1024 * 1024 / best(lambda: torch.cat(parts, 0)) / 1e9:.3f}")
    result("cat_dim2_gbs", f"{2 * 8 * 8 * 1024 * 1024 / best(lambda: torch.cat(parts, 1)) / 1e9:.3f}")
    del parts

    N = 16 * 1024 * 1024
    x = torch.rand(N // 64, 64)
    rows = torch.randint(0, N // 64, (N // 64,))
    result("index_select_gbs", f"{(2 * 4 * N + 8 * N / 64) / best(lambda: x.index_select(0, rows)) / 1e9:.3f}")
    flat = x.view(-1)
    idx = torch.randint(0, N, (N,))
    result("gather_gbs", f"{(4 * N + 8 * N + 4 * N) / best(lambda: flat.gather(0, idx)) / 1e9:.3f}")
    del x, flat, idx, rows

    s = torch.rand(N)
    result("sort16m_s", f"{best(lambda: s.sort(), min(reps, 3)):.4f}")
    del s

    result("peak_rss_mib", f"{rss_mib('VmHWM'):.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
