"""scripts/gen_random_fixtures.py: PyTorch's random streams, for the specs that
check rpchost's generator against them (spec/random_spec.lua). Run with
Debian's /usr/bin/python3 and PyTorch 1.13 (apt-get install python3-torch):

    /usr/bin/python3 scripts/gen_random_fixtures.py

It writes two Lua files under spec/fixtures/random/ (the suite reads the
committed files and never needs PyTorch):

  streams.lua   what torch's CPU generator gives after manual_seed(s), for seeds
                0, 1, 42 and 2^40 + 3: randperm (n = 1 .. 50000; torch 1.13 uses
                one algorithm for every n below 2^32 / 20), randint (ranges
                below 2^32, which draw 32 bits, and above, which draw 64; int64,
                int32 and float dtypes), rand and randn in float32 and float64
                (randn below 16 elements, at 16, and ragged sizes above, which
                take torch's three paths), a sequence of calls that share the
                generator (randn's kept sample crosses calls), initial_seed, and
                get_state's bytes.
  sampler.lua   torch.utils.data.distributed.DistributedSampler's indices for
                each rank of a few (n, world, seed, epoch, drop_last, shuffle).

Indices are written 0-based, as torch gives them; the spec adds 1. Floats are
written with repr(), which reads back as the same double (float32 values are
exact as doubles); 64-bit integers past 2^53 as LuaJIT's LL literals.
torch's float32 randn of 16 or more elements is its AVX2 kernel's on an x86-64
CPU with AVX2 (torch.__config__.show() says "CPU capability usage: AVX2"); the
script refuses to write on another.
"""
import os

import torch
import torch.utils.data.distributed as tud

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "spec", "fixtures", "random")
SEEDS = [0, 1, 42, 2**40 + 3]
PERM_FULL = [1, 2, 10, 100, 1000]
PERM_BIG = 50000
NORMAL_SIZES = [1, 2, 5, 15, 16, 17, 31, 32, 33, 100]
BIG_NORMAL = 100003  # a ragged end: the last 16 are redrawn
STRIDE = 997  # positions of BIG_NORMAL (and PERM_BIG) written: every 997th, and the last 20


def lua(v, indent=""):
    """v (nested lists, dicts with str keys, ints, floats, str, bool) as a Lua expression"""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v) if abs(v) < 2**53 else ("%dULL" % v if v >= 2**63 else "%dLL" % v)
    if isinstance(v, float):
        r = repr(v)
        return {"inf": "math.huge", "-inf": "-math.huge", "nan": "0/0"}.get(r, r)
    if isinstance(v, str):
        return '"%s"' % v.replace("\\", "\\\\").replace('"', '\\"')
    if isinstance(v, dict):
        inner = indent + "  "
        items = ["%s%s = %s" % (inner, k, lua(x, inner)) for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(v, (list, tuple)):
        flat = [lua(x, indent + "  ") for x in v]
        if all("\n" not in f for f in flat):
            lines, line = [], ""
            for f in flat:
                if len(line) + len(f) > 100 - len(indent):
                    lines.append(line)
                    line = ""
                line += f + ", "
            lines.append(line)
            return "{" + ("\n" + indent + " ").join(x.rstrip() for x in lines).rstrip(",") + "}"
        return "{\n" + ",\n".join(indent + "  " + f for f in flat) + "\n" + indent + "}"
    raise TypeError(type(v))


def values(t):
    return [float(x) if t.is_floating_point() else int(x) for x in t.tolist()]


def sampled(vals):
    """every STRIDE-th value (0-based positions) and the last 20, with their positions"""
    n = len(vals)
    pos = sorted(set(range(0, n, STRIDE)) | set(range(max(0, n - 20), n)))
    return {"n": n, "at": pos, "values": [vals[i] for i in pos]}


def stream(seed):
    g = torch.Generator()

    def fresh():
        g.manual_seed(seed)
        return g

    s = {"seed": seed, "initial_seed": fresh().initial_seed()}
    s["randperm"] = [{"n": n, "values": values(torch.randperm(n, generator=fresh()))} for n in PERM_FULL]
    big = values(torch.randperm(PERM_BIG, generator=fresh()))
    s["randperm_big"] = sampled(big)
    # a checksum over every position: sum of (i + 1) * p[i], below 2^53
    s["randperm_big"]["weighted_sum"] = sum((i + 1) * p for i, p in enumerate(big))
    ints = []
    for low, high, dtype, n in [(0, 10, torch.int64, 20), (-5, 5, torch.int64, 20), (0, 1000, torch.int32, 10),
                                (0, 2**32 + 5, torch.int64, 10), (-2**40, 2**40, torch.int64, 10),
                                (0, 2**62, torch.int64, 6), (-2**31, 2**31, torch.int32, 6),
                                (0, 100, torch.float32, 8), (0, 2**33, torch.float64, 8), (-2**24, 2**24, torch.float32, 8)]:
        t = torch.randint(low, high, (n,), dtype=dtype, generator=fresh())
        ints.append({"low": low, "high": high, "dtype": str(dtype).replace("torch.", ""), "values": values(t)})
    s["randint"] = ints
    s["rand"] = [{"dtype": name, "values": values(torch.rand(20, dtype=dt, generator=fresh()))}
                 for name, dt in [("float32", torch.float32), ("float64", torch.float64)]]
    normals = []
    for name, dt in [("float32", torch.float32), ("float64", torch.float64)]:
        for n in NORMAL_SIZES:
            normals.append({"dtype": name, "n": n, "values": values(torch.randn(n, dtype=dt, generator=fresh()))})
        big = sampled(values(torch.randn(BIG_NORMAL, dtype=dt, generator=fresh())))
        big["dtype"] = name
        normals.append(big)
    s["randn"] = normals
    return s


# one generator through several calls: randn's kept sample, and every op's
# draws, carry from one call to the next
SEQUENCE = [("randn", 3, "float64"), ("randn", 1, "float32"), ("rand", 2, "float64"), ("randn", 20, "float32"),
            ("randn", 1, "float64"), ("randperm", 5, None), ("randint", 3, None), ("randn", 2, "float64")]


def sequence(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    steps = []
    for op, n, dtype in SEQUENCE:
        dt = getattr(torch, dtype) if dtype else None
        if op == "randn":
            t = torch.randn(n, dtype=dt, generator=g)
        elif op == "rand":
            t = torch.rand(n, dtype=dt, generator=g)
        elif op == "randperm":
            t = torch.randperm(n, generator=g)
        else:
            t = torch.randint(0, 100, (n,), generator=g)
        steps.append({"op": op, "n": n, "dtype": dtype or "int64", "values": values(t)})
    return {"seed": seed, "steps": steps}


def state_hex(g):
    return g.get_state().numpy().tobytes().hex()


def states():
    g = torch.Generator()
    g.manual_seed(42)
    fresh = state_hex(g)
    torch.randn(3, dtype=torch.float64, generator=g)  # leaves a kept normal sample
    after = state_hex(g)
    nxt = values(torch.randn(4, dtype=torch.float64, generator=g))
    return {"seed": 42, "fresh": fresh, "after_randn3": after, "then_randn4": nxt}


SAMPLER_CASES = [(10, 3, 0, 0, False, True), (10, 3, 0, 1, False, True), (10, 3, 5, 2, True, True),
                 (7, 4, 1, 0, False, True), (2, 4, 0, 0, False, True), (100, 8, 42, 3, False, True),
                 (1000, 3, 0, 5, True, True), (13, 5, 0, 0, True, True), (10, 3, 0, 0, False, False),
                 (11, 4, 7, 0, True, False), (1, 1, 0, 0, False, True), (50, 1, 9, 4, False, True)]


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def sampler_cases():
    out = []
    for n, world, seed, epoch, drop_last, shuffle in SAMPLER_CASES:
        ranks = []
        for rank in range(world):
            s = tud.DistributedSampler(Sized(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                       drop_last=drop_last)
            s.set_epoch(epoch)
            ranks.append(list(iter(s)))
        out.append({"n": n, "world": world, "seed": seed, "epoch": epoch, "drop_last": drop_last, "shuffle": shuffle,
                    "ranks": ranks})
    return out


def write(name, body):
    header = ("-- spec/fixtures/random/%s: written by scripts/gen_random_fixtures.py with\n"
              "-- PyTorch %s; do not edit (run the script again).\n" % (name, torch.__version__))
    with open(os.path.join(OUT, name), "w") as f:
        f.write(header + "return " + lua(body) + "\n")


def main():
    if "CPU capability usage: AVX2" not in torch.__config__.show():
        raise SystemExit("torch does not use its AVX2 kernels here: float32 randn would not be the stream rpchost "
                         "reproduces (run on an x86-64 CPU with AVX2, without ATEN_CPU_CAPABILITY)")
    os.makedirs(OUT, exist_ok=True)
    write("streams.lua", {"torch_version": torch.__version__,
                          "default_seed": torch.Generator().initial_seed(),
                          "streams": [stream(s) for s in SEEDS],
                          "sequence": sequence(7),
                          "state": states()})
    write("sampler.lua", {"torch_version": torch.__version__, "cases": sampler_cases()})


if __name__ == "__main__":
    main()
