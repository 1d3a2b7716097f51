-- bench/ps_step.lua: the parameter-server tutorial's training step against the same
-- training in one process (issue 38: "within 1.25x of the one-process run").
--
-- Why: the step of scripts/examples/parameter_server (pytorch/examples'
-- rpc_parameter_server.py: 1 server holding the digits CNN, 1 trainer) is what a
-- user of RPC training pays per batch. What it could cost is the same model
-- trained in one process on the same batches: the difference is the price of the
-- distribution (a forward through RPC, the distributed backward, the remote
-- optimizer step).
--   ps     rank 1 trains through rank 0 exactly as the example does, minus its
--          printing: dist_autograd.context { out = net(data) (an rpc_sync to the
--          server's forward, which runs on clones of the weights); loss =
--          nll_loss(out, target); dist_autograd.backward(cid, {loss});
--          get_dist_gradients (the example's check that gradients arrived);
--          opt:step(cid) } with a DistributedOptimizer(SGD) over the server's
--          parameter RRefs;
--   local  the same Net trained in rank 1's process alone (rank 0 idle): out =
--          net(data) on clones of the weights, as the server's forward takes;
--          loss; loss:backward(); the gradients read; SGD step; zero_grad.
-- Both run the same batches of the digits set (batch 32), WARMUP untimed steps
-- then STEPS timed ones, each timed from its start to its end; the medians print.
--
-- usage: rpchost run --nproc-per-node 2 bench/ps_step.lua [STEPS] [WARMUP]
-- output (rank 1): "RESULT ps_step_med_us <v>", "RESULT local_step_med_us <v>",
-- "RESULT ps_over_local <ratio>" (bench/limit.py reads them).
local here = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = here .. "/../scripts/examples/parameter_server/?.lua;" .. here .. "/../scripts/examples/common/?.lua;" ..
  package.path
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local F = nn.functional
local optim = require "optim"
local dist_autograd = require "dist_autograd"
local sched = require "rpchost.sched"
local digits = require "digits"

local STEPS, WARMUP = tonumber(arg[1]) or 300, tonumber(arg[2]) or 50
local LR = 0.03

-- the example's own server: Net (the tutorial's MNIST CNN sized for 8x8
-- digits), ParameterServer, forward_on_clones, get_parameter_server,
-- remote_method
require "ps_server"

local function median(ts)
  table.sort(ts)
  return ts[math.ceil(#ts / 2)]
end

local rank = tonumber(os.getenv "RANK")
if rank == 0 then
  rpc.init_rpc("parameter_server", {rank = 0, world_size = 2})
  rpc.shutdown()
  return
end

local data = digits.load()
local D = tensor.data
local batches = {}
for x, y in D.DataLoader(D.TensorDataset(data.train.x, data.train.y), {batch_size = 32, shuffle = true, seed = 2}):iter() do
  if x:size(1) == 32 then batches[#batches + 1] = {x, y} end
end
local function batch(i)
  local b = batches[(i - 1) % #batches + 1]
  return b[1], b[2]
end
rpc.init_rpc("trainer_1", {rank = 1, world_size = 2})

-- the same training in this process alone
tensor.manual_seed(1)
local model = Net()
local sgd = optim.SGD(model:parameters(), {lr = LR})
local function local_step(i)
  local x, y = batch(i)
  local loss = F.nll_loss(forward_on_clones(model, x), y)
  loss:backward()
  for _, p in ipairs(model:parameters()) do assert(p.grad ~= nil, "local backward gave a parameter no gradient") end
  sgd:step()
  sgd:zero_grad()
  return loss:item()
end

-- through the parameter server, as the example trains
local server = rpc.remote("parameter_server", get_parameter_server)
local opt = rpc.DistributedOptimizer(optim.SGD, remote_method(ParameterServer.get_param_rrefs, server), {lr = LR})
local function ps_step(i)
  local x, y = batch(i)
  local l
  dist_autograd.context(function(cid)
    local loss = F.nll_loss(remote_method(ParameterServer.forward, server, x), y)
    dist_autograd.backward(cid, {loss})
    assert(next(remote_method(ParameterServer.get_dist_gradients, server, cid)) ~= nil, "the server got no gradients")
    opt:step(cid)
    l = loss:item()
  end)
  return l
end

local function timed(step)
  local ts, first, last = {}, nil, nil
  for i = 1, WARMUP do first = first or step(i) end
  for i = 1, STEPS do
    local t0 = sched.now()
    last = step(WARMUP + i)
    ts[#ts + 1] = sched.now() - t0
  end
  return median(ts), first, last
end

-- alternated, so that neither side gets the quieter half of the run
local lt, pt = {}, {}
local lfirst, llast, pfirst, plast
for round = 1, 2 do
  local m, f, l = timed(local_step)
  lt[round], lfirst, llast = m, lfirst or f, l
  m, f, l = timed(ps_step)
  pt[round], pfirst, plast = m, pfirst or f, l
end
assert(llast < lfirst and plast < pfirst, ("the loss did not fall (local %.3f -> %.3f, ps %.3f -> %.3f)"):format(
  lfirst, llast, pfirst, plast))
local l_med, p_med = math.min(lt[1], lt[2]), math.min(pt[1], pt[2])
print(("parameter-server step %.0f us, the same training in one process %.0f us: %.2fx (best of 2 medians, %d steps)")
  :format(p_med * 1e6, l_med * 1e6, p_med / l_med, STEPS))
print(("RESULT ps_step_med_us %.1f"):format(p_med * 1e6))
print(("RESULT local_step_med_us %.1f"):format(l_med * 1e6))
print(("RESULT ps_over_local %.3f"):format(p_med / l_med))
rpc.shutdown()
