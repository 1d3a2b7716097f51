"""scripts/gen_pt_fixtures.py: PyTorch checkpoints for the specs of nn.load's .pt
support (spec/pt_format_spec.lua). Run with Debian's /usr/bin/python3 and
PyTorch 1.13 (apt-get install python3-torch):

    /usr/bin/python3 scripts/gen_pt_fixtures.py

It writes spec/fixtures/pt/ (the suite reads the committed files and never needs
PyTorch):

  mlp.pt, conv.pth       model.state_dict() of a small MLP and of a conv net
                         (Conv2d, BatchNorm2d with its int64 num_batches_tracked,
                         Linear), as torch.save writes it; conv_io.pt holds an
                         input and the conv net's eval() output for it
  shared.pt              tensors sharing storages: a tensor saved twice, its
                         transpose, a row, a narrowed slice, a strided view, an
                         expanded (stride 0) tensor, a slice of a storage saved
                         alone
  dtypes.pt              every dtype rpchost has (float32, float64, int32, int64,
                         uint8, bool), a 0-dim tensor and an empty one
  float16.pt bfloat16.pt complex64.pt int8.pt
                         one tensor of a dtype rpchost lacks (key "bad") beside a
                         float32 one
  checkpoint_adam.pt, checkpoint_sgd.pt (and checkpoint_adam.pkl, the first's
                         data.pkl alone, which the spec fuzzes)
                         a training checkpoint {"model", "optimizer", "epoch",
                         "note", "x", "y", "after"}: the model and the optimizer
                         (Adam; SGD with momentum) after two steps of MSE on x, y,
                         and the model after a third step, for resuming here
  proto4.pt              mlp.pt's state_dict pickled with protocol 4 (FRAME,
                         MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL)
  new_layout.pt          mlp.pt rewritten in torch 2.x's layout: archive/ prefix,
                         .format_version, .storage_alignment, byteorder,
                         .data/serialization_id
  bigendian.pt           new_layout.pt with byteorder "big"
  legacy.pt              torch.save(..., _use_new_zipfile_serialization=False)
  torchscript.pt         torch.jit.save of a scripted module
  whole_module.pt        torch.save(model): the module object, not its state_dict
  evil_*.pt              pickles that must be refused: GLOBAL os.system,
                         REDUCE of builtins.eval, STACK_GLOBAL builtins.eval,
                         REDUCE of a storage class, INST, BUILD on a dict, a
                         persistent id that is not a storage, views reaching
                         past their storage (one by a size, one by a stride of
                         2^52 whose product with the size overflows 64-bit
                         arithmetic), a storage key
                         naming a path outside the archive
  expected.lua           per fixture, per key: dtype, shape, every value (floats
                         by repr, which reads back as the same double; int64 past
                         2^53 as LuaJIT LL literals), the keys' order; and the
                         error each refused file must give

The os.system pickle would run `touch /tmp/rpchost-pt-pwned` if anything
executed it; the spec checks that nothing did.
"""
import collections
import io
import os
import pickle
import struct
import zipfile

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "spec", "fixtures", "pt")
os.makedirs(OUT, exist_ok=True)
expected = collections.OrderedDict()


def path(name):
    return os.path.join(OUT, name)


def lua_str(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def lua_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v) if abs(v) < 2**53 else f"{v}LL"
    if isinstance(v, float):
        if v != v:
            return "0/0"
        if v in (float("inf"), float("-inf")):
            return "1/0" if v > 0 else "-1/0"
        return repr(v)
    if isinstance(v, str):
        return lua_str(v)
    if isinstance(v, (list, tuple)):
        return "{" + ", ".join(lua_value(x) for x in v) + "}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"[{lua_value(k)}] = {lua_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


DTYPE = {torch.float32: "float32", torch.float64: "float64", torch.int32: "int32", torch.int64: "int64",
         torch.uint8: "uint8", torch.bool: "bool"}


def describe(t):
    return collections.OrderedDict(dtype=DTYPE[t.dtype], shape=list(t.shape), values=t.flatten().tolist())


def describe_sd(sd):
    return collections.OrderedDict((k, describe(v)) for k, v in sd.items())


def record(name, sd):
    expected[name] = collections.OrderedDict(keys=list(sd.keys()), tensors=describe_sd(sd))


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def conv_net():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(64, 2))


# -- models -------------------------------------------------------------------
m = mlp()
torch.save(m.state_dict(), path("mlp.pt"))
record("mlp", m.state_dict())

c = conv_net()
c.train()
c(torch.randn(5, 1, 6, 6))  # running stats and num_batches_tracked move
c.eval()
torch.save(c.state_dict(), path("conv.pth"))
record("conv", c.state_dict())
x = torch.randn(2, 1, 6, 6)
with torch.no_grad():
    y = c(x)
torch.save({"x": x, "y": y}, path("conv_io.pt"))

# -- shared storages and views ---------------------------------------------------
base = torch.arange(24, dtype=torch.float32).view(4, 6)
alone = torch.arange(10, 15, dtype=torch.int64)
shared = collections.OrderedDict()
shared["base"] = base
shared["t"] = base.t()
shared["row"] = base[1]
shared["cols"] = base[:, 2:5]
shared["tied"] = base
shared["strided"] = base[::2, ::3]
shared["expanded"] = torch.arange(3, dtype=torch.float64).expand(4, 3)
shared["tail"] = alone[1:]
torch.save(shared, path("shared.pt"))
record("shared", shared)

# -- dtypes ----------------------------------------------------------------------
dt = collections.OrderedDict()
dt["f32"] = torch.tensor([1.5, -2.25, 3.0e-8, 1e30], dtype=torch.float32)
dt["f64"] = torch.tensor([[1.0 / 3, -1e-300], [2.5, 1e300]], dtype=torch.float64)
dt["i32"] = torch.tensor([-2**31, 2**31 - 1, 0, 7], dtype=torch.int32)
dt["i64"] = torch.tensor([-2**63, 2**63 - 1, 2**53 + 1, -5], dtype=torch.int64)
dt["u8"] = torch.tensor([0, 1, 128, 255], dtype=torch.uint8)
dt["b"] = torch.tensor([True, False, True], dtype=torch.bool)
dt["scalar"] = torch.tensor(2.5)
dt["empty"] = torch.zeros(0, 3)
torch.save(dt, path("dtypes.pt"))
record("dtypes", dt)

for name, t in [("float16", torch.ones(3).half()), ("bfloat16", torch.ones(3).bfloat16()),
                ("complex64", torch.ones(3, dtype=torch.complex64)), ("int8", torch.ones(3, dtype=torch.int8))]:
    torch.save(collections.OrderedDict([("ok", torch.ones(2)), ("bad", t)]), path(name + ".pt"))

# -- training checkpoints ----------------------------------------------------------------
def checkpoint(name, make_opt):
    model = mlp()
    opt = make_opt(model.parameters())
    torch.manual_seed(2)
    x, y = torch.randn(5, 4), torch.randn(5, 3)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()
    step()
    ck = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2, "note": "résumé", "x": x, "y": y}
    buf = io.BytesIO()
    torch.save(ck, buf)  # (a copy: the third step changes the tensors in place)
    step()
    ck = torch.load(io.BytesIO(buf.getvalue()))
    ck["after"] = model.state_dict()
    torch.save(ck, path(name + ".pt"))
    record(name + "_after", model.state_dict())
    o = ck["optimizer"]
    expected[name + "_optimizer"] = collections.OrderedDict(
        param_groups=[collections.OrderedDict((k, v) for k, v in g.items() if v is not None) for g in o["param_groups"]],
        state=collections.OrderedDict((i, describe_sd(s)) for i, s in o["state"].items()))


checkpoint("checkpoint_adam", lambda p: torch.optim.Adam(p, lr=0.01))
checkpoint("checkpoint_sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
with zipfile.ZipFile(path("checkpoint_adam.pt")) as z:  # its pickle alone, for fuzzing the unpickler
    with open(path("checkpoint_adam.pkl"), "wb") as f:
        f.write(z.read("checkpoint_adam/data.pkl"))

# -- layouts -------------------------------------------------------------------------------
torch.save(m.state_dict(), path("proto4.pt"), pickle_protocol=4)

with zipfile.ZipFile(path("mlp.pt")) as z:
    records = {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}


def writestr(z, name, data):
    # (a fixed date: the fixtures do not change when the script runs again)
    z.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)


def write_new_layout(name, byteorder):
    # torch 2.x's record order and names
    with zipfile.ZipFile(path(name), "w", zipfile.ZIP_STORED) as z:
        writestr(z, "archive/data.pkl", records["data.pkl"])
        writestr(z, "archive/.format_version", b"1")
        writestr(z, "archive/.storage_alignment", b"64")
        writestr(z, "archive/byteorder", byteorder)
        for k in sorted(k for k in records if k.startswith("data/")):
            writestr(z, "archive/" + k, records[k])
        writestr(z, "archive/version", b"3\n")
        writestr(z, "archive/.data/serialization_id", b"1234567890123456789012345678901234567890")


write_new_layout("new_layout.pt", b"little")
write_new_layout("bigendian.pt", b"big")

torch.save(collections.OrderedDict([("w", torch.ones(2))]), path("legacy.pt"), _use_new_zipfile_serialization=False)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.fc(x)


torch.jit.save(torch.jit.script(Tiny()), path("torchscript.pt"))
torch.save(Tiny(), path("whole_module.pt"))  # the model object, not its state_dict

# -- refused pickles ----------------------------------------------------------------------------


def archive(name, pkl, storages=None):
    with zipfile.ZipFile(path(name), "w", zipfile.ZIP_STORED) as z:
        writestr(z, "archive/data.pkl", pkl)
        for k, data in (storages or {}).items():
            writestr(z, "archive/data/" + k, data)
        writestr(z, "archive/version", b"3\n")


def binunicode(s):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


PWNED = "touch /tmp/rpchost-pt-pwned"
# GLOBAL os.system, called by REDUCE with a command
archive("evil_global.pt", b"\x80\x02cos\nsystem\n" + binunicode(PWNED) + b"\x85R.")
# GLOBAL builtins.eval, called by REDUCE
archive("evil_eval.pt", b"\x80\x02cbuiltins\neval\n" + binunicode("__import__('os').system('" + PWNED + "')") + b"\x85R.")
# protocol 4's STACK_GLOBAL naming builtins.eval
archive("evil_stack_global.pt", b"\x80\x04\x8c\x08builtins\x94\x8c\x04eval\x94\x93" + binunicode("1") + b"\x85R.")
# REDUCE of an allowed global that is not a callable (a storage class)
archive("evil_reduce_storage.pt", b"\x80\x02ctorch\nFloatStorage\n)R.")
# INST (protocol 0's instantiate-by-name)
archive("evil_inst.pt", b"\x80\x02(" + binunicode(PWNED) + b"ios\nsystem\n.")
# BUILD on a plain dict (only an OrderedDict's attributes may be set)
archive("evil_build.pt", b"\x80\x02}}" + binunicode("__class__") + b"Ns" + b"b.")
# a persistent id that is not ('storage', ...)
archive("evil_persid.pt", b"\x80\x02(" + binunicode("module") + binunicode("os") + b"tQ.")


class FakeStorage:
    pass


def tensor_pickle(pid, offset, size, stride):
    """A pickle of one tensor over persistent id pid, as torch writes it."""
    class T:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2, (FakeStorage(), offset, size, stride, False, collections.OrderedDict()))

    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return pid if isinstance(obj, FakeStorage) else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump(collections.OrderedDict([("w", T())]))
    return buf.getvalue()


four = struct.pack("<4f", 1, 2, 3, 4)
archive("evil_view.pt", tensor_pickle(("storage", torch.FloatStorage, "0", "cpu", 4), 0, (100,), (1,)), {"0": four})
archive("evil_overflow.pt", tensor_pickle(("storage", torch.FloatStorage, "0", "cpu", 4), 0, (4096,), (2**52,)),
        {"0": four})
archive("evil_key.pt", tensor_pickle(("storage", torch.FloatStorage, "../../../etc/passwd", "cpu", 4), 0, (4,), (1,)),
        {"0": four})

expected["refused"] = collections.OrderedDict([
    ("float16.pt", "sd['bad'] is float16 (torch.HalfStorage), a dtype rpchost does not have"),
    ("bfloat16.pt", "sd['bad'] is bfloat16 (torch.BFloat16Storage), a dtype rpchost does not have"),
    ("complex64.pt", "sd['bad'] is complex64 (torch.ComplexFloatStorage), a dtype rpchost does not have"),
    ("int8.pt", "sd['bad'] is int8 (torch.CharStorage), a dtype rpchost does not have"),
    ("bigendian.pt", "big-endian"),
    ("legacy.pt", "PyTorch's legacy format"),
    ("torchscript.pt", "TorchScript archive"),
    ("whole_module.pt", "global __main__.Tiny is not allowed"),
    ("evil_global.pt", "global os.system is not allowed"),
    ("evil_eval.pt", "global builtins.eval is not allowed"),
    ("evil_stack_global.pt", "global builtins.eval is not allowed"),
    ("evil_reduce_storage.pt", "REDUCE of torch.FloatStorage"),
    ("evil_inst.pt", "opcode INST ('i') is not allowed"),
    ("evil_build.pt", "BUILD on a dict"),
    ("evil_persid.pt", "persistent id 'module'"),
    ("evil_view.pt", "reaches element 99 of a storage of 4"),
    ("evil_overflow.pt", "reaches element"),
    ("evil_key.pt", "its storage '../../../etc/passwd' is missing"),
])

with open(path("expected.lua"), "w") as f:
    f.write("-- written by scripts/gen_pt_fixtures.py (torch %s): do not edit\n" % torch.__version__)
    f.write("return {\n")
    for k, v in expected.items():
        f.write(f"  [{lua_str(k)}] = {lua_value(v)},\n")
    f.write("}\n")

total = sum(os.path.getsize(path(n)) for n in os.listdir(OUT))
print(f"wrote {len(os.listdir(OUT))} files, {total} bytes, under {os.path.normpath(OUT)}")
