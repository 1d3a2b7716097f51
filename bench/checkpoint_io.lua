-- bench/checkpoint_io.lua DIR MIB: one round of rpchost's checkpoint I/O, run by
-- bench/checkpoint_io.py: a durable tensor.save of a MIB MiB float32 tensor
-- (.npy; atomic: written beside the target, fsync'd, renamed, directory
-- fsync'd), tensor.load of it, nn.save / nn.load of the same bytes as a
-- four-member .npz (CRC-32 computed while writing, checked while reading);
-- the loads also with {mmap = true} (the file mapped copy-on-write); first,
-- the time to write as many bytes of fresh memory (what a load's new tensor costs).
-- Prints "name seconds" lines, and the peak resident memory each step took
-- above what was resident before it ("name_peak_mib MiB").
local tensor, nn = require "tensor", require "nn"
local sched = require "rpchost.sched"
local dir, mib = arg[1], tonumber(arg[2] or "256")
local MiB = 1048576

local function reset_peak()
  local f = io.open("/proc/self/clear_refs", "w")
  if f then f:write("5"); f:close() end
end
local function peak()
  local f = io.open("/proc/self/status")
  local s = f:read("*a")
  f:close()
  return tonumber(s:match("VmHWM:%s*(%d+)")) * 1024
end

-- runs fn, printing its wall time and the peak memory it added
local function step(name, fn)
  collectgarbage()
  collectgarbage()
  reset_peak()
  local base = peak()
  local t0 = sched.now()
  local r = fn()
  local dt = sched.now() - t0
  print(("%s %.4f"):format(name, dt))
  print(("%s_peak_mib %.1f"):format(name, (peak() - base) / MiB))
  return r
end

local n = mib * MiB / 4
-- the floor under every load that makes a new tensor: writing MIB MiB of memory
-- this process never touched (a VM whose host maps guest pages as they are
-- touched makes this vary several-fold from run to run; torch.load pays it too)
step("first_touch", function() tensor.empty(n):fill_(0) end)
local t = tensor.rand(n)
step("tensor.save", function() tensor.save(t, dir .. "/rpchost.npy") end)
local back = step("tensor.load", function() return tensor.load(dir .. "/rpchost.npy") end)
assert(back:numel() == n)
back = nil
back = step("tensor.load_mmap", function() return tensor.load(dir .. "/rpchost.npy", {mmap = true}) end)
assert(back:numel() == n)
back = nil
local q = n / 4
local sd = {}
for i = 1, 4 do sd["layer" .. i .. ".weight"] = t:narrow(1, (i - 1) * q + 1, q) end
step("nn.save", function() nn.save(sd, dir .. "/rpchost.npz") end)
local d = step("nn.load", function() return nn.load(dir .. "/rpchost.npz") end)
assert(d["layer4.weight"]:numel() == q)
d = nil
d = step("nn.load_mmap", function() return nn.load(dir .. "/rpchost.npz", {mmap = true}) end)
assert(d["layer4.weight"]:numel() == q)
