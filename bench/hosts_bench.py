#!/usr/bin/python3
"""bench/hosts_bench.py: rpchost vs PyTorch (TensorPipe RPC, gloo) across simulated hosts.

Why: a world of several hosts is what a job that outgrew one machine runs, and two
questions matter there: what a pair of ranks on different hosts gets over the wire, and
whether a pair on one host keeps its same-host speed when the world meets on the
network. This driver makes hosts as spec/simhosts.lua does (a network namespace each,
with its own PID, mount and UTS namespaces, on a private bridge), shapes each host's
link to --rate (tc tbf; default 1gbit), and runs, rpchost then PyTorch in each round:

  layout "cross":   rank 0 on h1, rank 1 on h2 (RPC), 1 rank on each of 3 hosts (collectives)
  layout "nodes":   rank 0 on h1, rank 1 on h2 (RPC), 2 ranks on each of 2 hosts (collectives:
                    rpchost runs the small ones host by host, each host through its arena)
  layout "pair":    2 ranks on h1, the world meeting at h1's network address
  layout "loopback": 2 ranks on h1, the world meeting at 127.0.0.1 (the one-host baseline)

  rpc_sync latency (p50, us)            bench/rpc_latency.lua     | bench/torch_rpc.py latency
  rpc_async throughput (calls/s, w=64)  bench/rpc_throughput.lua  | bench/torch_rpc.py throughput
  all_reduce 4 KiB (us), 16 MiB (ms, and % of the link's rate for the ring's 2(n-1)/n
  of the tensor each rank sends)        bench/collectives.lua     | bench/torch_collectives.py

PyTorch's ranks get GLOO_SOCKET_IFNAME and TP_SOCKET_IFNAME (eth0 on the simulated hosts,
lo on loopback), as a PyTorch job across hosts sets them. The table shows medians over
rounds; the "pair" rows beside the "loopback" rows say whether the same-host paths hold
in a world that meets on the network (they should be within 10%).

Needs root, ip, tc (the kernel's tbf qdisc), unshare and nsenter; exits 2 with the reason
otherwise. Bounded: every world is killed after RUN_TIMEOUT s; --quick runs one round of
small counts (a smoke test; on a loaded 2-core machine the numbers mean little).

usage: /usr/bin/python3 bench/hosts_bench.py [--quick] [--rounds N] [--rate 1gbit]
                                            [--rpchost PATH] [--only rpchost|pytorch]
  (bench/hosts_bench.sh builds rpchost if needed and runs this as root.)
"""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.dont_write_bytecode = True
sys.path.insert(0, HERE)
import rpc_bench  # noqa: E402  (parse_results, BenchError, tail)

RUN_TIMEOUT = 120
IP, TC, UNSHARE, NSENTER = "/usr/sbin/ip", "/usr/sbin/tc", "/usr/bin/unshare", "/usr/bin/nsenter"
BenchError = rpc_bench.BenchError


def sh(*cmd):
    r = subprocess.run(list(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise BenchError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def v4(i):
    return f"10.213.8.{i}"


class Hosts:
    """n simulated hosts on one bridge, each link shaped to `rate` (None: unshaped)."""

    def __init__(self, n, rate):
        self.tag = str(os.getpid() % 100000)
        self.br = f"rhbb-{self.tag}"
        self.ns, self.holders, self.inner = [], [], []
        self.run = tempfile.mkdtemp(prefix="rhbench-run-")
        try:
            sh(IP, "netns", "add", self.br)
            sh(IP, "-n", self.br, "link", "add", "br0", "type", "bridge")
            sh(IP, "-n", self.br, "link", "set", "br0", "up")
            for i in range(1, n + 1):
                ns = f"rhb{i}-{self.tag}"
                self.ns.append(ns)
                sh(IP, "netns", "add", ns)
                sh(IP, "-n", ns, "link", "set", "lo", "up")
                sh(IP, "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"h{i}", "netns", self.br)
                sh(IP, "-n", self.br, "link", "set", f"h{i}", "master", "br0", "up")
                sh(IP, "-n", ns, "addr", "add", f"{v4(i)}/24", "dev", "eth0")
                sh(IP, "-n", ns, "link", "set", "eth0", "up")
                if rate:
                    # (each host's sending side: what a 1 Gbit NIC allows out)
                    sh(IP, "netns", "exec", ns, TC, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                       "burst", "256kb", "latency", "50ms")
                self.hold(i)
        except BaseException:
            self.close()
            raise

    def hold(self, i):
        setup = f"hostname h{i} && mount -t tmpfs -o mode=0700 tmpfs {self.run} && exec sleep 100000"
        p = subprocess.Popen([IP, "netns", "exec", self.ns[i - 1], UNSHARE, "--pid", "--fork", "--kill-child",
                              "--mount-proc", "--uts", "--mount", "--propagation", "private", "/bin/sh", "-c", setup])
        self.holders.append(p)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                    kid = int(f.read().split()[0])
                with open(f"/proc/{kid}/comm") as f:
                    if f.read().strip() == "sleep":
                        self.inner.append(kid)
                        return
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.02)
        raise BenchError(f"host h{i}'s namespaces did not come up")

    def start(self, i, cmd, env):
        e = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "RPCHOST_STORE_HOSTED", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
            e.pop(k, None)
        e.update({k: str(v) for k, v in env.items()})
        e["XDG_RUNTIME_DIR"] = self.run
        return subprocess.Popen([NSENTER, "-t", str(self.inner[i - 1]), "-n", "-m", "-u", "-p", "--"] + cmd,
                                env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def close(self):
        for p in self.holders:
            p.kill()
            p.wait()
        for ns in self.ns + [self.br]:
            subprocess.run([IP, "netns", "del", ns], stderr=subprocess.DEVNULL)
        shutil.rmtree(self.run, ignore_errors=True)


def world(hosts, placement, cmd, master, port, extra):
    """Starts len(placement) ranks of cmd (rank r on host placement[r]) and waits: rank 0's RESULTs."""
    count, seen, procs = {}, {}, []
    for h in placement:
        count[h] = count.get(h, 0) + 1
    for r, h in enumerate(placement):
        seen[h] = seen.get(h, 0) + 1
        env = dict(RANK=r, WORLD_SIZE=len(placement), LOCAL_RANK=seen[h] - 1, LOCAL_WORLD_SIZE=count[h],
                   MASTER_ADDR=master, MASTER_PORT=port, RPCHOST_TOKEN="bench", **extra)
        procs.append(hosts.start(h, cmd, env))
    deadline = time.monotonic() + RUN_TIMEOUT
    outs, errs, codes = [], [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise BenchError(f"timed out after {RUN_TIMEOUT}s: {' '.join(cmd)}")
        outs.append(out)
        errs.append(err)
        codes.append(p.returncode)
    if any(codes):
        raise BenchError(f"exit codes {codes}: {' '.join(cmd)}\n{rpc_bench.tail(outs[0])}\n"
                         f"{rpc_bench.tail(''.join(errs))}")
    return rpc_bench.parse_results(outs[0])


LAYOUTS = {
    # name: (rpc placement, collectives placement, meeting address, interface for PyTorch)
    "cross": ([1, 2], [1, 2, 3], v4(1), "eth0"),
    # two ranks on each of two hosts (torchrun's N per node): rpchost's small
    # collectives run host by host, each host through its arena
    "nodes": ([1, 2], [1, 1, 2, 2], v4(1), "eth0"),
    "pair": ([1, 1], [1, 1], v4(1), "eth0"),
    "loopback": ([1, 1], [1, 1], "127.0.0.1", "lo"),
}


def side_cmds(side, exe, cfg):
    """The commands of one side: latency, throughput, collectives."""
    # (absolute paths: entering a host's mount namespace leaves the process at its root)
    c, b = cfg, lambda f: os.path.join(HERE, f)
    ars = [f"ar:4096:{c['ar_small']}", f"ar:16777216:{c['ar_big']}"]
    if side == "rpchost":
        return ([exe, b("rpc_latency.lua"), c["calls"], c["warmup"], c["max_s"]],
                [exe, b("rpc_throughput.lua"), c["tput_calls"], c["max_s"], 64],
                [exe, b("collectives.lua"), c["max_s"]] + ars)
    py = "/usr/bin/python3"
    return ([py, b("torch_rpc.py"), "latency", c["calls"], c["warmup"], c["max_s"]],
            [py, b("torch_rpc.py"), "throughput", c["tput_calls"], c["max_s"], 64],
            [py, b("torch_collectives.py"), c["max_s"]] + ars)


def measure(hosts, side, exe, layout, cfg, port):
    rpc_place, coll_place, master, ifname = LAYOUTS[layout]
    extra = {"GLOO_SOCKET_IFNAME": ifname, "TP_SOCKET_IFNAME": ifname} if side == "pytorch" else {}
    lat, tput, coll = side_cmds(side, exe, cfg)
    out = {}
    r = world(hosts, rpc_place, [str(a) for a in lat], master, port, extra)
    out["lat_us"] = r.get("p50_us")
    r = world(hosts, rpc_place, [str(a) for a in tput], master, port + 1, extra)
    out["calls_per_s"] = r.get("calls_per_s_w64")
    r = world(hosts, coll_place, [str(a) for a in coll], master, port + 2, extra)
    out["ar4k_us"] = r["ar4096_med_s"] * 1e6 if "ar4096_med_s" in r else None
    out["ar16m_ms"] = r["ar16777216_med_s"] * 1e3 if "ar16777216_med_s" in r else None
    out["ranks"] = len(coll_place)
    return out


# What TCP itself carries over one shaped link: a plain socket from h1 to h2,
# 64 MiB, timed by the receiver from its first byte to the sender's close. The
# ring's share of the line rate can reach at most this share (a 1500-byte MTU
# leaves 1448 bytes of payload in each frame the shaper counts).
SINK = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1)
c, _ = s.accept()
n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(b)
print("RESULT tcp_bytes %d" % n)
print("RESULT tcp_s %.6f" % (time.perf_counter() - t0))
"""
SOURCE = r"""
import socket, sys, time
for _ in range(200):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        time.sleep(0.05)
buf = b"x" * (1 << 20)
for _ in range(64):
    c.sendall(buf)
c.close()
"""


def tcp_goodput(hosts, port):
    """Bits per second a plain TCP stream carries from h1 to h2 (None if it could not run)."""
    py = "/usr/bin/python3"
    sink = hosts.start(2, [py, "-c", SINK, str(port)], {})
    src = hosts.start(1, [py, "-c", SOURCE, v4(2), str(port)], {})
    try:
        src.communicate(timeout=RUN_TIMEOUT)
        out, _ = sink.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        sink.kill()
        src.kill()
        return None
    r = rpc_bench.parse_results(out)
    return r["tcp_bytes"] * 8 / r["tcp_s"] if r.get("tcp_s") else None


def rate_bits(rate):
    units = {"k": 1e3, "m": 1e6, "g": 1e9}
    s = rate.lower().rstrip("bit").rstrip("b")
    return float(s[:-1]) * units[s[-1]] if s[-1] in units else float(s)


def main(argv):
    quick = "--quick" in argv
    rounds, rate, exe, only = (1 if quick else 3), "1gbit", os.path.join(ROOT, "build", "rpchost"), None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--rounds":
            rounds, i = int(argv[i + 1]), i + 1
        elif a == "--rate":
            rate, i = argv[i + 1], i + 1
        elif a == "--rpchost":
            exe, i = argv[i + 1], i + 1
        elif a == "--only":
            only, i = argv[i + 1], i + 1
        elif a != "--quick":
            sys.exit(__doc__)
        i += 1
    exe = os.path.abspath(os.environ.get("RPCHOST", exe))
    if os.geteuid() != 0:
        print("hosts_bench: needs root (network, PID and mount namespaces, tc)", file=sys.stderr)
        sys.exit(2)
    for tool in (IP, TC, UNSHARE, NSENTER):
        if not os.path.exists(tool):
            print(f"hosts_bench: needs {tool}", file=sys.stderr)
            sys.exit(2)
    cfg = (dict(calls=300, warmup=50, tput_calls=3000, max_s=10, ar_small=50, ar_big=3) if quick else
           dict(calls=5000, warmup=500, tput_calls=50000, max_s=20, ar_small=1000, ar_big=20))
    sides = [s for s in ("rpchost", "pytorch") if only in (None, s)]
    try:
        hosts = Hosts(3, rate)
    except BenchError as e:
        print(f"hosts_bench: cannot make the simulated hosts: {e}", file=sys.stderr)
        sys.exit(2)
    results = {}
    port = 29600
    goodput = []
    try:
        for _ in range(rounds):
            port += 1
            goodput.append(tcp_goodput(hosts, port))
            for layout in LAYOUTS:
                for side in sides:
                    port += 3
                    got = measure(hosts, side, exe, layout, cfg, port)
                    for k, v in got.items():
                        results.setdefault((layout, side, k), []).append(v)
    except BenchError as e:
        print(f"hosts_bench: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        hosts.close()

    def med(layout, side, k):
        xs = [x for x in results.get((layout, side, k), []) if x is not None]
        return statistics.median(xs) if xs else None

    def fmt(x, f="{:.1f}"):
        return "-" if x is None else f.format(x)

    bits = rate_bits(rate)
    print(f"\nsimulated hosts, each link {rate} (tc tbf); medians of {rounds} round(s)\n")
    print("| layout | side | rpc_sync p50 us | rpc_async calls/s (w=64) | all_reduce 4 KiB us | "
          "all_reduce 16 MiB ms | 16 MiB % of line rate |")
    print("|---|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        for side in sides:
            ms = med(layout, side, "ar16m_ms")
            n = LAYOUTS[layout][1].__len__()
            line = ""
            if ms and layout == "cross":
                # the ring: each rank sends 2(n-1)/n of the tensor through its link
                need = 2 * (n - 1) / n * 16 * 2 ** 20 * 8 / bits
                line = f"{100 * need / (ms / 1e3):.0f}%"
            print(f"| {layout} | {side} | {fmt(med(layout, side, 'lat_us'))} | "
                  f"{fmt(med(layout, side, 'calls_per_s'), '{:.0f}')} | {fmt(med(layout, side, 'ar4k_us'))} | "
                  f"{fmt(ms, '{:.2f}')} | {line} |")
    gp = [g for g in goodput if g]
    if gp:
        tcp = statistics.median(gp)
        n = len(LAYOUTS["cross"][1])
        need = 2 * (n - 1) / n * 16 * 2 ** 20 * 8
        print(f"\nTCP itself between two hosts: {tcp / 1e6:.0f} Mbit/s of payload, {100 * tcp / bits:.1f}% of the "
              f"line rate (one 64 MiB stream; the most the ring can reach). The 16 MiB all_reduce across hosts "
              f"in % of that:")
        for side in sides:
            ms = med("cross", side, "ar16m_ms")
            if ms:
                print(f"  {side}: {100 * need / (ms / 1e3) / tcp:.1f}%")
    if "rpchost" in sides:
        print("\nrpchost, same-host pair in a network world over the loopback world (1.00 = as fast):")
        for k, name in (("lat_us", "rpc_sync p50"), ("calls_per_s", "rpc_async calls/s"), ("ar4k_us", "all_reduce 4 KiB"),
                        ("ar16m_ms", "all_reduce 16 MiB")):
            a, b = med("pair", "rpchost", k), med("loopback", "rpchost", k)
            if a and b:
                ratio = (b / a) if k == "calls_per_s" else (a / b)
                print(f"  {name}: {ratio:.2f}x the loopback world's time")


if __name__ == "__main__":
    main(sys.argv[1:])
