-- bench/pipeline_shards.lua: one rank's compute in the pipeline tutorial, rpchost side.
--
-- Why: scripts/examples/pipeline/ spends its time in its two ResNet shards'
-- forward and backward (the RPCs around them are another matter); this times
-- them in one process, without RPC, on the tutorial benchmark's micro-batch.
-- The shard classes are read from the example itself (the text before
-- DistResNet50), so the two cannot drift apart. Steps are timed back to back
-- with no collection between them: the GC work a step causes is part of it.
-- Each step's wall time and CPU time (os.clock) are recorded.
-- Counterpart: bench/torch_pipeline_shards.py. Driver: bench/pipeline_shards.sh.
--
-- usage: rpchost bench/pipeline_shards.lua [MICRO_BATCH] [REPS] [WIDTH] [IMAGE] [CLASSES]
--   defaults: 8 30 16 64 100 (bench/tutorials/run.sh's pipeline row: split 8)
-- output: per case "RESULT <case>_med_s <seconds>" (wall), "CPU <case> <seconds>" (median
--   CPU time of a step), "BEST <case> <seconds>" (the fastest step: on a loaded machine, the
--   one least disturbed) and "LIVE <case> <peak live tensor MiB>"
tensor = require "tensor"
nn = require "nn"
local now = require("rpchost.sched").now

local mb, reps = tonumber(arg[1]) or 8, tonumber(arg[2]) or 30
local width, image, classes = tonumber(arg[3]) or 16, tonumber(arg[4]) or 64, tonumber(arg[5]) or 100

local here = arg[0]:match("^(.*)/[^/]*$") or "."
local f = assert(io.open(here .. "/../scripts/examples/pipeline/main.lua"))
local src = f:read("*a")
f:close()
local from, to = src:find("local function conv1x1", 1, true), src:find("DistResNet50 =", 1, true)
assert(from and to, "bench/pipeline_shards.lua: the example no longer defines conv1x1 ... DistResNet50")
assert(loadstring(src:sub(from, to - 1), "=pipeline/main.lua"))()

local function case(name, m, x, grad)
  local function step()
    if grad then
      local y = m.seq(x)
      if m.fc then y = m.fc(y:flatten(2)) end
      y:sum():backward()
    else
      tensor.no_grad(function() local y = m.seq(x); if m.fc then m.fc(y:flatten(2)) end end)
    end
  end
  for _ = 1, 3 do step() end
  collectgarbage()
  local live0 = tensor.live_bytes()
  tensor.reset_max_live_bytes()
  local ts, cs = {}, {}
  for i = 1, reps do
    local t0, c0 = now(), os.clock()
    step()
    ts[i], cs[i] = now() - t0, os.clock() - c0
  end
  table.sort(ts)
  table.sort(cs)
  print(("RESULT %s_med_s %.6f"):format(name, ts[math.floor((#ts + 1) / 2)]))
  print(("CPU %s %.6f"):format(name, cs[math.floor((#cs + 1) / 2)]))
  print(("BEST %s %.6f"):format(name, ts[1]))
  print(("LIVE %s %.1f"):format(name, (tensor.max_live_bytes() - live0) / 2^20))
end

local s1, s2 = ResNetShard1(width), ResNetShard2(width, classes)
tensor.manual_seed(0)
local x1 = tensor.randn(mb, 3, image, image)
local x2 = tensor.no_grad(function() return s1.seq(x1) end)
case("shard1_fwd_bwd", s1, x1, true)
case("shard2_fwd_bwd", s2, x2, true)
case("shard2_fwd", s2, x2, false)
