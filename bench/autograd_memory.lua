-- bench/autograd_memory.lua: memory of a long training loop (issue: no leaks).
-- A small MLP (forward, backward, SGD step) runs STEPS steps; every STEPS/20
-- steps it prints the step, the process's resident set (MB, as the loop left
-- it), tensor.live_bytes() (MB, after a full collection) and the Lua heap (MB,
-- likewise): every curve must be flat after the first samples.
--   rpchost bench/autograd_memory.lua [steps=100000]
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"

local steps = tonumber(arg and arg[1]) or 100000

local function rss_mb()
  local f = io.open("/proc/self/status")
  if not f then return 0 end
  local s = f:read("*a")
  f:close()
  return (tonumber(s:match("VmRSS:%s*(%d+)")) or 0) / 1024
end

tensor.manual_seed(0)
local model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
local opt = optim.SGD(model:parameters(), {lr = 0.01, momentum = 0.9})
local loss_fn = nn.MSELoss()
local x, y = tensor.randn(32, 8), tensor.randn(32, 1)

local every = math.max(1, math.floor(steps / 20))
local t0 = os.clock()
print(("%8s %10s %12s %10s %10s"):format("step", "rss_MB", "live_MB", "lua_MB", "loss"))
for step = 1, steps do
  opt:zero_grad()
  local loss = loss_fn(model(x), y)
  loss:backward()
  opt:step()
  if step % every == 0 or step == 1 then
    local rss = rss_mb()
    collectgarbage()
    print(("%8d %10.1f %12.3f %10.2f %10.5f"):format(step, rss, tensor.live_bytes() / 2 ^ 20,
      collectgarbage("count") / 1024, loss:item()))
    io.stdout:flush()
  end
end
print(("%.1f steps/s"):format(steps / (os.clock() - t0)))
