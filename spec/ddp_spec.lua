-- nn.DistributedDataParallel as PyTorch 1.13's, in worlds of real processes:
-- no_sync (gradients accumulate locally, the next synced backward averages the
-- sums), parameters with requires_grad = false (never given a gradient),
-- buffers (broadcast from the group's first rank at creation and before each
-- forward, broadcast_buffers = false turning the latter off), and parameters
-- some or all ranks did not use (find_unused_parameters; without it, PyTorch's
-- unfinished-reduction error at the next forward). Ported from the cases of
-- torch/testing/_internal/distributed/distributed_test.py
-- (_test_accumulate_gradients_no_sync, test_ddp_broadcast_buffer,
-- test_ddp_control_flow_different_across_ranks,
-- test_ddp_unused_params_rebuild_buckets_exception,
-- test_DistributedDataParallel_requires_grad), each value compared with the
-- same computation in one process.
local S = require "spec.support"

local function run(n, body, opts)
  local r = S.world(n, S.prelude .. [[
    local tensor = require "tensor"
    local optim = require "optim"
    local nn = require "nn"
    local f64 = {dtype = tensor.float64}
    local function close(a, b, tol)
      return a ~= nil and b ~= nil and tensor.abs(a - b):max():item() <= (tol or 1e-9)
    end
    -- the largest difference between this tensor on any two ranks (0: equal)
    local function spread(t)
      local l = {}
      for i = 1, world_size do l[i] = tensor.zeros(t:size(), {dtype = t.dtype}) end
      dist.all_gather(l, t:detach():contiguous())
      local d = 0
      for i = 2, world_size do d = math.max(d, tensor.abs(l[i]:to(tensor.float64) - l[1]:to(tensor.float64)):max():item()) end
      return d, l
    end
    -- two bias-free layers; the second runs only when asked (control flow)
    Toy = nn.Module:extend("Toy")
    function Toy:__init()
      self.lin1 = nn.Linear(4, 4, {bias = false, dtype = tensor.float64})
      self.lin2 = nn.Linear(4, 4, {bias = false, dtype = tensor.float64})
    end
    function Toy:forward(x, second)
      local h = self.lin1(x):relu()
      if second then return self.lin2(h) end
      return h
    end
    dist.init_process_group{backend = "gloo"}
  ]] .. body .. [[
    dist.destroy_process_group()
  ]], opts)
  assert.are.equal(0, r.status, r.out .. r.err)
  S.assert_checks(r)
end

describe("DistributedDataParallel no_sync #world", function()
  it("accumulates locally inside no_sync and averages the sums at the next synced backward", function()
    run(3, [[
      local W = world_size
      local function model() return nn.Sequential(nn.Linear(4, 5, f64), nn.Tanh(), nn.Linear(5, 2, f64)) end
      tensor.manual_seed(10 + rank) -- DDP gives every rank rank 0's weights
      local ddp = nn.DistributedDataParallel(model(), {bucket_cap_mb = 0.0001})
      -- one process: the whole batch (what synced steps give), and each rank's
      -- own shard (what a step inside no_sync gives), from rank 0's weights
      tensor.manual_seed(10)
      local whole = model()
      local own = {}
      for r = 0, W - 1 do
        tensor.manual_seed(10)
        own[r] = model()
      end
      local lossf = nn.MSELoss()
      local function step(m, x, y) lossf(m(x), y):backward() end
      tensor.manual_seed(77)
      local X, Y = tensor.randn(2 * W, 4, f64), tensor.randn(2 * W, 2, f64)
      local function shard(t, r) return t:narrow(1, 2 * r + 1, 2) end

      -- a forward under no_grad inside no_sync accumulates nothing
      tensor.no_grad(function() ddp:no_sync(function() ddp(shard(X, rank)) end) end)
      check("no gradient after a no_grad forward", ddp:parameters()[1].grad == nil)

      local local_ok, differ, synced_ok = true, true, true
      for it = 1, 4 do
        step(whole, X, Y)
        for r = 0, W - 1 do step(own[r], shard(X, r), shard(Y, r)) end
        if it % 2 == 1 then
          ddp:no_sync(function() step(ddp, shard(X, rank), shard(Y, rank)) end)
        else
          step(ddp, shard(X, rank), shard(Y, rank))
        end
        for i, p in ipairs(ddp:parameters()) do
          if it % 2 == 1 then
            -- the synced sum so far plus this rank's own shard's gradient
            local_ok = local_ok and close(p.grad, own[rank]:parameters()[i].grad, 1e-9)
            differ = differ and spread(p.grad) > 0
          else
            synced_ok = synced_ok and close(p.grad, whole:parameters()[i].grad, 1e-9)
          end
        end
        -- after a synced step every replica holds the average: so do the
        -- one-process copies of each rank
        if it % 2 == 0 then
          for r = 0, W - 1 do
            for i, p in ipairs(own[r]:parameters()) do p.grad = whole:parameters()[i].grad:clone() end
          end
        end
        -- new data for the next round, the same on every rank
        tensor.manual_seed(1337 + it)
        local perm = tensor.randperm(2 * W)
        X, Y = X:index_select(1, perm), Y:index_select(1, perm)
      end
      check("inside no_sync: this rank's own gradient", local_ok)
      check("inside no_sync: the ranks' gradients differ", differ)
      check("the next synced backward averages the accumulated sums", synced_ok)

      -- a forward inside no_sync arms nothing: its backward outside stays local
      -- (PyTorch decides at the forward)
      ddp:zero_grad()
      local loss = ddp:no_sync(function() return lossf(ddp(shard(X, rank)), shard(Y, rank)) end)
      loss:backward()
      tensor.manual_seed(10)
      local mine = model() -- (the replica's weights: rank 0's, never stepped)
      lossf(mine(shard(X, rank)), shard(Y, rank)):backward()
      local apart = spread(ddp:parameters()[1].grad) > 0 -- (a collective: every rank makes it)
      check("a no_sync forward's backward outside stays local",
        close(ddp:parameters()[1].grad, mine:parameters()[1].grad, 1e-12) and apart)

      -- no_sync returns fn's results and puts the flag back, even when fn fails
      local a, b = ddp:no_sync(function(x, y) return x + 1, y end, 1, "two")
      check("no_sync returns fn's results", a == 2 and b == "two")
      local failed, e = raises(ddp.no_sync, ddp, function() error("inside") end)
      check("no_sync raises fn's error", failed and tostring(e):find("inside", 1, true) ~= nil, e)
      check("no_sync restores the sync flag", ddp.require_backward_grad_sync == true)
    ]])
  end)
end)

describe("DistributedDataParallel parameters without requires_grad #world", function()
  it("leaves their .grad nil, averages the others, and refuses a module with nothing to train", function()
    run(2, [[
      local Net = nn.Module:extend("FrozenNet")
      function Net:__init()
        self.frozen = nn.Parameter(tensor.randn(2, f64), false)
        self:register_parameter("steps", tensor.tensor({rank + 1}, {dtype = tensor.int64}))
        self.fc = nn.Linear(3, 2, f64)
      end
      function Net:forward(x) return self.fc(x) * self.frozen + self.steps:to(tensor.float64) end
      tensor.manual_seed(30 + rank)
      local net = Net()
      local ddp = nn.DistributedDataParallel(net)
      check("every parameter starts as rank 0's", spread(net.steps) == 0 and spread(net.frozen) == 0
        and net.steps[1]:item() == 1)
      tensor.manual_seed(8)
      local X = tensor.randn(4, 3, f64)
      local x = X:narrow(1, 2 * rank + 1, 2)
      ddp(x):sum():backward()
      check("an int64 parameter gets no gradient", net.steps.grad == nil, net.steps.grad)
      check("a frozen float parameter gets no gradient", net.frozen.grad == nil, net.frozen.grad)
      -- the trainable ones: the average, as one process on the whole batch
      tensor.manual_seed(30)
      local ref = Net()
      ref.steps:fill_(1)
      ref(X):sum():backward()
      check("the others are averaged", close(net.fc.weight.grad * 2, ref.fc.weight.grad, 1e-9)
        and close(net.fc.bias.grad * 2, ref.fc.bias.grad, 1e-9))
      local Still = nn.Module:extend("Still")
      function Still:__init() self.w = nn.Parameter(tensor.ones(2), false) end
      local failed, e = raises(nn.DistributedDataParallel, Still())
      check("a module with nothing to train is refused", failed and tostring(e):find("not needed", 1, true) ~= nil, e)
    ]])
  end)
end)

describe("DistributedDataParallel buffers #world", function()
  it("broadcasts the first rank's buffers at creation and before each forward; broadcast_buffers = false stops the latter", function()
    run(3, [[
      BufNet = nn.Module:extend("BufNet")
      function BufNet:__init()
        self.fc = nn.Linear(3, 4, f64)
        self.bn = nn.BatchNorm1d(4, f64)
        self:register_buffer("buffer", tensor.randn(1, 2, f64))
      end
      function BufNet:forward(x) return self.bn(self.fc(x)) end
      local function make()
        tensor.manual_seed(40 + rank) -- every rank its own weights, buffer and statistics
        local m = BufNet()
        m(tensor.randn(6, 3, f64)) -- running statistics of this rank's own data
        return m
      end
      local function buffers_spread(m)
        local d = 0
        for _, b in ipairs(m:buffers()) do d = math.max(d, (spread(b))) end
        return d
      end
      local m = make()
      -- rank 0's buffers, as they are before DDP
      local want = {}
      for i, b in ipairs(m:buffers()) do local _, l = spread(b); want[i] = l[1] end
      check("the ranks' buffers differ before", buffers_spread(m) > 0)
      local ddp = nn.DistributedDataParallel(m)
      local same = true
      for i, b in ipairs(m:buffers()) do same = same and b:equal(want[i]) end
      check("at creation every rank has rank 0's buffers", same)
      tensor.manual_seed(50 + rank)
      local x = tensor.randn(5, 3, f64) -- each rank its own data
      -- (PyTorch's test_ddp_broadcast_buffer) rank 0 replaces a buffer before
      -- each forward: every rank runs with it
      local seen = true
      for _ = 1, 2 do
        if rank == 0 then ddp.module.buffer = ddp.module.buffer + 1 end
        ddp(x):sum():backward()
        seen = seen and spread(ddp.module.buffer) == 0
      end
      check("a buffer rank 0 replaced reaches every rank at the next forward", seen)
      -- the running statistics: each rank's forward moves its own; the next
      -- forward starts from rank 0's
      check("a training forward moves each rank's own statistics", spread(m.bn.running_mean) > 0)
      local _, l = spread(m.bn.running_mean)
      local r0 = l[1]
      ddp:eval()
      tensor.no_grad(function() ddp(x) end)
      local others = spread(m.bn.running_var) == 0 and spread(m.bn.num_batches_tracked) == 0
      check("the next forward starts from rank 0's statistics", m.bn.running_mean:equal(r0) and others)
      -- (PyTorch's require_forward_param_sync) a forward without gradients
      -- turns the broadcast off until a forward with them has run
      if rank == 0 then ddp.module.buffer = ddp.module.buffer + 1 end
      tensor.no_grad(function() ddp(x) end)
      check("after a forward under no_grad the next forward does not broadcast", spread(ddp.module.buffer) > 0)
      ddp:train()
      ddp(x):sum():backward()
      check("nor the next forward with gradients", spread(ddp.module.buffer) > 0)
      ddp(x):sum():backward()
      check("but the one after it does", spread(ddp.module.buffer) == 0)

      -- broadcast_buffers = false: rank 0's at creation (PyTorch 1.13 syncs
      -- every buffer then), each rank its own afterwards
      local m2 = make()
      local ddp2 = nn.DistributedDataParallel(m2, {broadcast_buffers = false})
      check("broadcast_buffers = false: rank 0's buffers at creation", buffers_spread(m2) == 0)
      if rank == 0 then ddp2.module.buffer = ddp2.module.buffer + 1 end
      ddp2(x):sum():backward()
      ddp2(x):sum():backward()
      check("broadcast_buffers = false: never broadcast before a forward",
        spread(ddp2.module.buffer) > 0 and spread(m2.bn.running_mean) > 0)
    ]])
  end)
end)

describe("DistributedDataParallel unused parameters #world", function()
  it("find_unused_parameters: a parameter no rank used keeps its .grad, one some used gets the average with zeros", function()
    -- (PyTorch's test_ddp_control_flow_different_across_ranks) lin2 goes unused
    -- on every rank on odd iterations, and is used on rank 1 alone on even ones
    run(3, [[
      local W = world_size
      tensor.manual_seed(20 + rank)
      local ddp = nn.DistributedDataParallel(Toy(), {find_unused_parameters = true, bucket_cap_mb = 0.0001})
      local net = ddp.module
      -- weight decay: a zero gradient would move a weight, a nil one leaves it
      local opt = optim.SGD(ddp:parameters(), {lr = 0.1, weight_decay = 0.5})
      -- one process: every rank's loss from rank 0's weights, averaged
      tensor.manual_seed(20)
      local ref = Toy()
      local ropt = optim.SGD(ref:parameters(), {lr = 0.1, weight_decay = 0.5})
      tensor.manual_seed(5)
      local X = tensor.randn(2 * W, 4, f64)
      local function x_of(r) return X:narrow(1, 2 * r + 1, 2) end
      local nil_when_unused, averaged = true, true
      for it = 1, 6 do
        local used = it % 2 == 0
        opt:zero_grad()
        ddp(x_of(rank), used and rank == 1):sum():backward()
        ropt:zero_grad()
        local total = nil
        for r = 0, W - 1 do
          local l = ref(x_of(r), used and r == 1):sum() / W
          total = total and total + l or l
        end
        total:backward()
        if used then
          averaged = averaged and close(net.lin2.weight.grad, ref.lin2.weight.grad, 1e-9)
            and close(net.lin1.weight.grad, ref.lin1.weight.grad, 1e-9)
        else
          nil_when_unused = nil_when_unused and net.lin2.weight.grad == nil and ref.lin2.weight.grad == nil
            and close(net.lin1.weight.grad, ref.lin1.weight.grad, 1e-9)
        end
        opt:step()
        ropt:step()
      end
      check("unused on every rank: .grad stays nil", nil_when_unused)
      check("used on one rank: the average with zeros from the others", averaged)
      check("the optimizer skips it: weights as one process's",
        close(net.lin1.weight, ref.lin1.weight, 1e-9) and close(net.lin2.weight, ref.lin2.weight, 1e-9))
      check("replicas equal", spread(net.lin1.weight) == 0 and spread(net.lin2.weight) == 0)
      -- a .grad already there is left as it is when no rank used the parameter
      local mine = tensor.full({4, 4}, rank + 1, f64)
      net.lin2.weight.grad = mine
      ddp(x_of(rank), false):sum():backward()
      check("unused on every rank: an existing .grad untouched",
        net.lin2.weight.grad ~= nil and net.lin2.weight.grad:equal(tensor.full({4, 4}, rank + 1, f64)))
      -- and it is what a rank that did not use it contributes when another did
      net.lin2.weight.grad = tensor.full({4, 4}, rank + 1, f64)
      net.lin1.weight.grad = nil
      ddp(x_of(rank), rank == 1):sum():backward()
      ref.lin1.weight.grad, ref.lin2.weight.grad = nil, nil
      tensor.no_grad(function()
        for i, p in ipairs(ref:parameters()) do p:copy_(ddp:parameters()[i]) end
      end)
      ref(x_of(1), true):sum():backward()
      -- rank 1's .grad is its old one plus its gradient; the others' their old ones
      local want = (ref.lin2.weight.grad + tensor.full({4, 4}, 2, f64) + tensor.full({4, 4}, 1, f64)
        + tensor.full({4, 4}, 3, f64)) / W
      check("a rank that did not use it contributes its existing .grad", close(net.lin2.weight.grad, want, 1e-9))
    ]])
  end)

  it("without find_unused_parameters: gradients stay local and the next forward raises PyTorch's error", function()
    -- (PyTorch's test_ddp_unused_params_rebuild_buckets_exception)
    run(2, [[
      tensor.manual_seed(20 + rank)
      local ddp = nn.DistributedDataParallel(Toy())
      local net = ddp.module
      tensor.manual_seed(5)
      local x = tensor.randn(4, 4, f64):narrow(1, 2 * rank + 1, 2)
      ddp(x, false):sum():backward()
      -- one process, this rank's data, rank 0's weights
      tensor.manual_seed(20)
      local ref = Toy()
      ref(x, false):sum():backward()
      local apart = spread(net.lin1.weight.grad) > 0 -- (a collective: every rank makes it)
      check("the reduction never finished: each rank keeps its own gradient",
        close(net.lin1.weight.grad, ref.lin1.weight.grad, 1e-12) and apart)
      check("the unused parameter has no gradient", net.lin2.weight.grad == nil)
      local failed, e = raises(ddp, x, false)
      local msg = tostring(e)
      check("the next forward raises", failed and msg:find(
        "Expected to have finished reduction in the prior iteration before starting a new one", 1, true) ~= nil, msg)
      check("naming the parameter", msg:find("Parameters which did not receive grad for rank " .. rank .. ": lin2.weight",
        1, true) ~= nil, msg)
      check("and its index", msg:find("Parameter indices which did not receive grad for rank " .. rank .. ": 2", 1, true)
        ~= nil, msg)
      check("suggesting find_unused_parameters", msg:find("find_unused_parameters", 1, true) ~= nil, msg)
      check("a forward without gradients still runs", (pcall(tensor.no_grad, function() return ddp(x, false) end)))
      check("every later forward raises too", (raises(ddp, x, false)))
    ]])
  end)
end)
