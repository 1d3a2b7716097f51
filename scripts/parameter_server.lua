-- A parameter server and its trainers:
--   rpchost run --nproc-per-node 3 scripts/parameter_server.lua [steps]
-- Rank 0 holds a linear model's weights in a Lua object behind an RRef; every other
-- rank trains on its own synthetic data, pulling the weights and pushing
-- hand-computed gradients through the RRef's proxies. The loss falls.
local rpc = require "rpc"
local tensor = require "tensor"

local DIM, BATCH = 8, 64
local steps = tonumber((...)) or 60

ParameterServer = {}
ParameterServer.__index = ParameterServer

function ParameterServer.new(dim, lr)
  return setmetatable({w = tensor.zeros(dim, 1, {dtype = tensor.float64}), b = 0, lr = lr, updates = 0},
                      ParameterServer)
end

function ParameterServer:get_weights() return self.w, self.b end

function ParameterServer:apply_gradients(gw, gb)
  self.w:sub_(gw * self.lr)
  self.b = self.b - self.lr * gb
  self.updates = self.updates + 1
  return self.updates
end

-- The data every trainer shares the shape of: y = X w* + b* + noise.
local function synthetic(seed)
  tensor.manual_seed(seed)
  local w_true = tensor.arange(1, DIM + 1, {dtype = tensor.float64}):view(DIM, 1) / DIM
  local X = tensor.randn(BATCH, DIM, {dtype = tensor.float64})
  local y = X:matmul(w_true) + 0.5 + tensor.randn(BATCH, 1, {dtype = tensor.float64}) * 0.01
  return X, y
end

-- Runs on each trainer; `ps` is a UserRRef forked from the owner.
function train(ps, n)
  local me = rpc.get_worker_info().name
  local X, y = synthetic(rpc.get_worker_info().id)
  local first, last
  for step = 1, n do
    local w, b = ps:rpc_sync():get_weights()
    local err = X:matmul(w) + b - y
    local loss = (err * err):mean():item()
    first = first or loss
    last = loss
    if step == 1 or step % 20 == 0 or step == n then
      print(("%s step %3d loss %.6f"):format(me, step, loss))
    end
    local gw = X:t():matmul(err) * (2 / BATCH)
    local gb = err:mean():item() * 2
    ps:rpc_sync():apply_gradients(gw, gb)
  end
  return first, last
end

local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
rpc.init_rpc(rank == 0 and "ps" or ("trainer" .. rank), {rank = rank, world_size = world_size})
if rank == 0 then
  local ps = rpc.RRef(ParameterServer.new(DIM, 0.05))
  local futs = {}
  for r = 1, world_size - 1 do futs[#futs + 1] = rpc.rpc_async(r, train, {ps, steps}) end
  local fell = true
  for i, f in ipairs(futs) do
    local first, last = f:wait()
    fell = fell and last < first / 10
    print(("trainer%d: loss %.6f -> %.6f"):format(i, first, last))
  end
  local server = ps:local_value()
  print(("parameter server: %d updates, bias %.3f (true 0.5), loss %s"):format(server.updates, server.b,
    fell and "fell on every trainer" or "DID NOT FALL"))
end
rpc.shutdown()
