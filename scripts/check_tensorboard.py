#!/usr/bin/env python3
"""Reads rpchost's SummaryWriter output with readers that are not rpchost's.

Not part of the test suite (which reads the files back with spec/tfevents_reader.lua,
a reader written from the format): this script needs Python packages the suite must
not depend on. It runs rpchost to write scalars, add_scalars series, histograms, text
and a purge_step into a fresh directory, prints how many add_scalar calls a second
the writer took, and then reads every event file with, in order of preference:

  1. TensorBoard's own reader, tensorboard.backend.event_processing's
     EventAccumulator (what `tensorboard --logdir` loads runs with; its record
     reader checks both CRCs), when the `tensorboard` Python package is installed;
  2. else Google's protobuf runtime (Debian: apt-get install python3-protobuf),
     parsing each record as TensorBoard's Event message, declared here from
     TensorBoard's event.proto, summary.proto, histogram.proto, tensor.proto and
     tensor_shape.proto field numbers, after checking both of the record's masked
     CRC32Cs with a CRC32C computed here.

It exits 0 when every value reads back as written, 1 on a mismatch, 2 when neither
reader is installed.

    python3 scripts/check_tensorboard.py [path/to/rpchost]
"""

import glob
import math
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WRITE = r"""
local SummaryWriter = require("rpchost.summary").SummaryWriter
local tensor = require "tensor"
local dir = arg[1]
local w = SummaryWriter{log_dir = dir}
for i = 1, 1000 do w:add_scalar("loss", 1 / i, i) end
w:add_scalar("big_step", 3, 2 ^ 40)
for i = 1, 3 do w:add_scalars("lr", {encoder = i, decoder = 10 * i}, i) end
w:add_histogram("list", {1, 2, 3, 3}, 1, 4)
tensor.manual_seed(0)
w:add_histogram("randn", tensor.randn(10000), 2)
w:add_text("notes", "lr = 0.1, *batch* 32", 3)
w:close()
local p = SummaryWriter{log_dir = dir .. "/purged", purge_step = 5}
p:close()
-- the writer's rate: add_scalar calls a second, buffered (written at close)
local r = SummaryWriter{log_dir = dir .. "/rate"}
local clock = os.clock()
for i = 1, 300000 do r:add_scalar("rate", i, i) end
r:close()
print(("add_scalar: %.0f calls a second"):format(300000 / (os.clock() - clock)))
"""

EXPECT_SCALARS = [(i, 1 / i) for i in range(1, 1001)]


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def fail(msg):
    print("MISMATCH: " + msg)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


# --- 1. TensorBoard's own reader -------------------------------------------------
def with_tensorboard(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def load(d):
        ea = EventAccumulator(d, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
        ea.Reload()
        return ea

    ea = load(logdir)
    loss = [(e.step, e.value) for e in ea.Scalars("loss")]
    check(loss == [(s, f32(v)) for s, v in EXPECT_SCALARS], "loss scalars differ")
    check([e.step for e in ea.Scalars("big_step")] == [2 ** 40], "an int64 step")
    h = ea.Histograms("list")[0].histogram_value
    check((h.min, h.max, h.num, h.sum, h.sum_squares) == (1, 3, 4, 9, 23), "histogram statistics: %r" % (h,))
    check(list(h.bucket_limit) == [1, 1.5, 2, 2.5, 3] and list(h.bucket) == [0, 1, 0, 1, 2],
          "histogram buckets: %r %r" % (list(h.bucket_limit), list(h.bucket)))
    check(ea.Histograms("randn")[0].histogram_value.num == 10000, "the randn histogram's count")
    t = ea.Tensors("notes/text_summary")[0].tensor_proto
    check(t.string_val[0] == b"lr = 0.1, *batch* 32", "text: %r" % (t,))
    check(ea.PluginTagToContent("text").keys() >= {"notes/text_summary"}, "the text plugin's tags")
    for name, mul in (("encoder", 1), ("decoder", 10)):
        sub = load(os.path.join(logdir, "lr_" + name))
        check([(e.step, e.value) for e in sub.Scalars("lr")] == [(i, mul * i) for i in (1, 2, 3)],
              "add_scalars' " + name)
    return "TensorBoard's EventAccumulator"


# --- 2. protobuf's runtime against TensorBoard's field numbers -----------------------
def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF


def masked(c):
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    with open(path, "rb") as f:
        s = f.read()
    i, out = 0, []
    while i < len(s):
        head = s[i:i + 8]
        (n,) = struct.unpack("<Q", head)
        (hcrc,) = struct.unpack("<I", s[i + 8:i + 12])
        check(hcrc == masked(crc32c(head)), "%s: the length CRC at byte %d" % (path, i))
        data = s[i + 12:i + 12 + n]
        (dcrc,) = struct.unpack("<I", s[i + 12 + n:i + 16 + n])
        check(len(data) == n and dcrc == masked(crc32c(data)), "%s: the data CRC at byte %d" % (path, i))
        out.append(data)
        i += 16 + n
    return out


def event_class():
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="rpchost_check_event.proto", package="tb", syntax="proto3")

    def msg(name, *fields):
        m = fd.message_type.add(name=name)
        for fname, num, ftype, label, tname in fields:
            f = m.field.add(name=fname, number=num, type=ftype, label=label or F.LABEL_OPTIONAL)
            if tname:
                f.type_name = ".tb." + tname
        return m

    R = F.LABEL_REPEATED
    msg("PluginData", ("plugin_name", 1, F.TYPE_STRING, None, None), ("content", 2, F.TYPE_BYTES, None, None))
    msg("SummaryMetadata", ("plugin_data", 1, F.TYPE_MESSAGE, None, "PluginData"))
    msg("Dim", ("size", 1, F.TYPE_INT64, None, None), ("name", 2, F.TYPE_STRING, None, None))
    msg("TensorShapeProto", ("dim", 2, F.TYPE_MESSAGE, R, "Dim"))
    msg("TensorProto", ("dtype", 1, F.TYPE_INT32, None, None),
        ("tensor_shape", 2, F.TYPE_MESSAGE, None, "TensorShapeProto"),
        ("string_val", 8, F.TYPE_BYTES, R, None))
    msg("HistogramProto", ("min", 1, F.TYPE_DOUBLE, None, None), ("max", 2, F.TYPE_DOUBLE, None, None),
        ("num", 3, F.TYPE_DOUBLE, None, None), ("sum", 4, F.TYPE_DOUBLE, None, None),
        ("sum_squares", 5, F.TYPE_DOUBLE, None, None), ("bucket_limit", 6, F.TYPE_DOUBLE, R, None),
        ("bucket", 7, F.TYPE_DOUBLE, R, None))
    msg("Value", ("tag", 1, F.TYPE_STRING, None, None), ("simple_value", 2, F.TYPE_FLOAT, None, None),
        ("histo", 5, F.TYPE_MESSAGE, None, "HistogramProto"), ("tensor", 8, F.TYPE_MESSAGE, None, "TensorProto"),
        ("metadata", 9, F.TYPE_MESSAGE, None, "SummaryMetadata"))
    msg("Summary", ("value", 1, F.TYPE_MESSAGE, R, "Value"))
    msg("SessionLog", ("status", 1, F.TYPE_INT32, None, None))
    msg("Event", ("wall_time", 1, F.TYPE_DOUBLE, None, None), ("step", 2, F.TYPE_INT64, None, None),
        ("file_version", 3, F.TYPE_STRING, None, None), ("summary", 5, F.TYPE_MESSAGE, None, "Summary"),
        ("session_log", 7, F.TYPE_MESSAGE, None, "SessionLog"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    desc = pool.FindMessageTypeByName("tb.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


def with_protobuf(logdir):
    Event = event_class()

    def events(d):
        out = []
        for path in sorted(glob.glob(os.path.join(d, "events.out.tfevents.*"))):
            for data in records(path):
                e = Event()
                e.ParseFromString(data)
                check(e.SerializeToString() == data, "%s: protobuf re-encodes a record differently" % path)
                out.append(e)
        return out

    evs = events(logdir)
    check(evs[0].file_version == "brain.Event:2", "the first record")
    vals = {}
    for e in evs:
        for v in e.summary.value:
            vals.setdefault(v.tag, []).append((e.step, v))
    check([(s, v.simple_value) for s, v in vals["loss"]] == [(s, f32(x)) for s, x in EXPECT_SCALARS],
          "loss scalars differ")
    check(vals["big_step"][0][0] == 2 ** 40, "an int64 step")
    h = vals["list"][0][1].histo
    check((h.min, h.max, h.num, h.sum, h.sum_squares) == (1, 3, 4, 9, 23), "histogram statistics")
    check(list(h.bucket_limit) == [1, 1.5, 2, 2.5, 3] and list(h.bucket) == [0, 1, 0, 1, 2], "histogram buckets")
    r = vals["randn"][0][1].histo
    check(r.num == 10000 and sum(r.bucket) == 10000 and r.bucket[0] == 0, "the randn histogram")
    t = vals["notes/text_summary"][0][1]
    check(t.metadata.plugin_data.plugin_name == "text" and t.tensor.dtype == 7
          and list(t.tensor.string_val) == [b"lr = 0.1, *batch* 32"]
          and [d.size for d in t.tensor.tensor_shape.dim] == [1], "text")
    for name, mul in (("encoder", 1), ("decoder", 10)):
        sub = [(e.step, v.simple_value) for e in events(os.path.join(logdir, "lr_" + name)) for v in e.summary.value]
        check(sub == [(i, mul * i) for i in (1, 2, 3)], "add_scalars' " + name)
    p = events(os.path.join(logdir, "purged"))
    check([(e.step, e.session_log.status) for e in p if e.HasField("session_log")] == [(5, 1)], "purge_step")
    return "protobuf %s with TensorBoard's field numbers" % __import__("google.protobuf").protobuf.__version__


def main():
    rpchost = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "rpchost")
    logdir = tempfile.mkdtemp(prefix="rpchost-tb-")
    script = os.path.join(logdir, "write.lua")
    with open(script, "w") as f:
        f.write(WRITE)
    out = subprocess.run([rpchost, script, logdir], check=True, capture_output=True, text=True).stdout
    print(out.strip())
    try:
        import tensorboard  # noqa: F401
        reader = with_tensorboard
    except ImportError:
        try:
            import google.protobuf  # noqa: F401
            reader = with_protobuf
        except ImportError:
            print("neither the tensorboard nor the protobuf Python package is installed: "
                  "apt-get install python3-protobuf (or install tensorboard) and run again")
            sys.exit(2)
    used = reader(logdir)
    print("ok: every scalar, add_scalars series, histogram and text read back by " + used)


if __name__ == "__main__":
    main()
