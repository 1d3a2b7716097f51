-- nn.Pipe (docs/pipeline.md): a Sequential cut into stages and micro-batches
-- gives the un-pipelined model's output and gradients, in one process and
-- across workers, for 1, 2 and 4 stages, every checkpoint mode and both
-- schedules; chunks that do not divide the batch, tuples, deferred BatchNorm,
-- the balance helpers (torchgpipe's partitioning, checked against its output),
-- and every misuse named.
local S = require "spec.support"
local tensor = require "tensor"
local nn = require "nn"

local f64 = {dtype = tensor.float64}

-- a float64 MLP (float64: a pipelined run may sum gradients in another order)
local function mlp(seed)
  tensor.manual_seed(seed or 1)
  return nn.Sequential(nn.Linear(4, 8, f64), nn.Tanh(), nn.Linear(8, 8, f64), nn.ReLU(), nn.Linear(8, 3, f64))
end

local function max_diff(a, b) return (a - b):abs():max():item() end

-- the plain model's output and parameter gradients for loss = sum(out^2)
local function reference(seq, x)
  seq:zero_grad()
  local out = seq(x)
  out:pow(2):sum():backward()
  local grads = {}
  for i, p in ipairs(seq:parameters()) do grads[i] = p.grad:clone() end
  seq:zero_grad()
  return out:detach(), grads
end

local function grad_diff(seq, want)
  local d = 0
  for i, p in ipairs(seq:parameters()) do d = math.max(d, max_diff(p.grad, want[i])) end
  seq:zero_grad()
  return d
end

local BALANCES = {[1] = {5}, [2] = {2, 3}, [4] = {1, 2, 1, 1}}
local CHECKPOINTS = {"never", "except_last", "always"}

-- a layer that counts its forwards and the rows each one saw
Counted = nn.Module:extend("Counted")
function Counted:__init() self.calls, self.rows = 0, {} end
function Counted:forward(x)
  self.calls = self.calls + 1
  self.rows[#self.rows + 1] = x:size(1)
  return x
end

describe("nn.Pipe in one process #unit", function()
  it("gives the plain model's output and gradients for 1, 2 and 4 stages in every checkpoint mode", function()
    local seq = mlp()
    local x = tensor.randn(10, 4, f64)
    local want, grads = reference(seq, x)
    for _, n in ipairs{1, 2, 4} do
      for _, ck in ipairs(CHECKPOINTS) do
        local pipe = nn.Pipe(seq, {chunks = 4, balance = BALANCES[n], checkpoint = ck})
        local rref = pipe(x)
        local out = rref:local_value()
        assert.are.equal(out, rref:to_here())
        assert.is_true(max_diff(out, want) < 1e-12, ("%d stages, %s: output"):format(n, ck))
        out:pow(2):sum():backward()
        assert.is_true(grad_diff(seq, grads) < 1e-12, ("%d stages, %s: gradients"):format(n, ck))
      end
    end
  end)

  it("train_step gives the plain model's loss and gradients with GPipe and 1F1B", function()
    local seq = mlp()
    local x, y = tensor.randn(10, 4, f64), tensor.randn(10, 3, f64)
    local mse = nn.MSELoss()
    seq:zero_grad()
    local plain = mse(seq(x), y)
    plain:backward()
    local grads = {}
    for i, p in ipairs(seq:parameters()) do grads[i] = p.grad:clone() end
    seq:zero_grad()
    for _, n in ipairs{1, 2, 4} do
      for _, ck in ipairs(CHECKPOINTS) do
        for _, sch in ipairs{"gpipe", "1f1b"} do
          local what = ("%d stages, %s, %s"):format(n, ck, sch)
          local pipe = nn.Pipe(seq, {chunks = 4, balance = BALANCES[n], checkpoint = ck, schedule = sch})
          local loss, parts = pipe:train_step(x, y, mse)
          assert.are.equal(4, #parts, what)
          assert.is_true(math.abs(loss - plain:item()) < 1e-12, what .. ": loss")
          assert.is_true(grad_diff(seq, grads) < 1e-12, what .. ": gradients")
        end
      end
    end
    -- a summed loss: the micro-batches' losses are not weighted
    local sum_fn = function(o, t) return (o - t):pow(2):sum() end
    local want = sum_fn(seq(x), y):item()
    local loss = nn.Pipe(seq, {chunks = 3, balance = {2, 3}}):train_step(x, y, sum_fn, {loss_reduction = "sum"})
    assert.is_true(math.abs(loss - want) < 1e-10)
    seq:zero_grad()
  end)

  it("recomputes in backward exactly the micro-batches its checkpoint mode names", function()
    local seq = nn.Sequential(nn.Linear(3, 3, f64), Counted())
    local counter = seq:get(2)
    local x = tensor.randn(8, 3, f64)
    local forwards = {never = 4, except_last = 7, always = 8}
    for ck, n in pairs(forwards) do
      for _, how in ipairs{"forward", "train_step"} do
        counter.calls = 0
        local pipe = nn.Pipe(seq, {chunks = 4, checkpoint = ck})
        if how == "forward" then pipe(x):local_value():sum():backward()
        else pipe:train_step(x, tensor.zeros(8, 3, f64), nn.MSELoss()) end
        assert.are.equal(n, counter.calls, ck .. " " .. how)
      end
    end
    -- no recomputation in eval mode, nor without gradients
    local pipe = nn.Pipe(seq, {chunks = 4, checkpoint = "always"})
    counter.calls = 0
    pipe:eval()
    pipe(x):local_value():sum():backward()
    assert.are.equal(4, counter.calls)
    pipe:train()
    counter.calls = 0
    tensor.no_grad(function() pipe(x) end)
    assert.are.equal(4, counter.calls)
  end)

  it("cuts a batch chunks does not divide as torch.chunk does, and joins the outputs in order", function()
    local seq = nn.Sequential(Counted(), nn.Linear(2, 2, f64))
    local counter = seq:get(1)
    local cases = {{10, 4, {3, 3, 3, 1}}, {6, 4, {2, 2, 2}}, {3, 8, {1, 1, 1}}, {5, 1, {5}}}
    for _, c in ipairs(cases) do
      counter.rows = {}
      local x = tensor.randn(c[1], 2, f64)
      local out = nn.Pipe(seq, {chunks = c[2], checkpoint = "never"})(x):local_value()
      assert.are.same(c[3], counter.rows)
      assert.is_true(max_diff(out, seq(x)) < 1e-12)
    end
  end)

  it("passes tuples between stages, cuts every tensor input, and gives non-tensors and NoChunk whole", function()
    -- a layer taking (x, scale, bias) and giving (y, scale, bias) on, and one giving (sums, scale)
    Scale = nn.Module:extend("Scale")
    function Scale:forward(x, s, b) return x * s + b, s, b end
    Sum = nn.Module:extend("Sum")
    function Sum:forward(x, s) return {x:sum(2), s, n = 2} end
    local seq = nn.Sequential(Scale(), Scale(), Sum())
    local x = tensor.randn(6, 3, f64)
    local pipe = nn.Pipe(seq, {chunks = 3, balance = {1, 1, 1}})
    local out = pipe(x, 2, nn.pipeline.NoChunk(tensor.ones(3, f64))):local_value()
    assert.are.equal(2, out.n)
    assert.is_true(max_diff(out[1], ((x * 2 + 1) * 2 + 1):sum(2)) < 1e-12)
    assert.are.same({2, 2, 2}, out[2]) -- (a non-tensor: one per micro-batch)
  end)

  it("keeps each BatchNorm's running statistics per mini-batch with deferred_batch_norm", function()
    tensor.manual_seed(3)
    local plain = nn.Sequential(nn.Linear(3, 4, f64), nn.BatchNorm1d(4, f64))
    local seq = nn.deepcopy(plain)
    local pipe = nn.Pipe(seq, {chunks = 4, balance = {1, 1}, deferred_batch_norm = true, checkpoint = "always"})
    local dbn = seq:get(2)
    assert.are.equal("DeferredBatchNorm", getmetatable(dbn).name)
    local x = tensor.randn(16, 3, f64)
    for _ = 1, 2 do
      plain(x)
      pipe(x):local_value():sum():backward() -- (the checkpointed recomputation is not counted)
    end
    local bn = plain:get(2)
    assert.is_true(max_diff(dbn.running_mean, bn.running_mean) < 1e-12)
    assert.is_true(max_diff(dbn.running_var, bn.running_var) < 1e-12)
    assert.are.equal(2, dbn.num_batches_tracked:item())
    -- a batch cut into fewer micro-batches than chunks still counts once
    pipe(x:narrow(1, 1, 6)) -- (3 micro-batches of 2)
    assert.are.equal(3, dbn.num_batches_tracked:item())
  end)

  it("balances as torchgpipe's block partition does, by time and by size", function()
    local solve = require("rpchost.nn.pipe_balance").solve
    -- (torch.distributed.pipeline.sync._balance.blockpartition.solve's answers)
    assert.are.same({4, 2}, solve({1, 2, 3, 4, 5, 6}, 2))
    assert.are.same({3, 2, 1}, solve({1, 2, 3, 4, 5, 6}, 3))
    assert.are.same({2, 2, 2, 2}, solve({10, 1, 1, 1, 1, 1, 1, 10}, 4))
    assert.are.same({3, 3, 2, 3}, solve({3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5}, 4))
    local seq = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    local x = tensor.randn(32, 64)
    for _, b in ipairs{nn.pipeline.balance_by_time(2, seq, x, {timeout = 0.05}),
                       nn.pipeline.balance_by_size(3, seq, x, {chunks = 4})} do
      local sum = 0
      for _, n in ipairs(b) do assert.is_true(n >= 1); sum = sum + n end
      assert.are.equal(5, sum)
      nn.Pipe(seq, {balance = b})
    end
    assert.has_error(function() solve({1, 2}, 3) end,
      "balance: the Sequential has 2 layers, fewer than the 3 partitions asked for")
  end)

  it("names every misuse", function()
    local seq = mlp()
    local x = tensor.randn(8, 4, f64)
    local function fails(want, fn, ...)
      local ok, e = pcall(fn, ...)
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find(want, 1, true), tostring(e))
    end
    fails("balance {2, 2} adds up to 4 layers but the Sequential has 5", nn.Pipe, seq, {balance = {2, 2}})
    fails("balance[2] is 0: every stage needs a positive whole number of layers", nn.Pipe, seq, {balance = {5, 0}})
    fails("placement names 3 stages but balance has 2: give one placement per stage", nn.Pipe, seq,
      {balance = {2, 3}, placement = {"cpu", "cpu", "cpu"}})
    fails("placement names 6 stages but the Sequential has only 5 layers", nn.Pipe, seq,
      {placement = {"cpu", "cpu", "cpu", "cpu", "cpu", "cpu"}})
    fails("chunks must be a positive integer (the number of micro-batches), got 0", nn.Pipe, seq, {chunks = 0})
    fails("chunks must be a positive integer (the number of micro-batches), got 1.5", nn.Pipe, seq, {chunks = 1.5})
    fails("checkpoint must be \"always\", \"except_last\" or \"never\", got sometimes", nn.Pipe, seq,
      {checkpoint = "sometimes"})
    fails("schedule must be \"gpipe\" or \"1f1b\", got zb", nn.Pipe, seq, {schedule = "zb"})
    fails("unknown option chunk (the options are", nn.Pipe, seq, {chunk = 2})
    fails("expected an nn.Sequential to cut into stages, got Linear", nn.Pipe, nn.Linear(2, 2))
    local lin = nn.Linear(2, 2)
    fails("the Sequential holds the same module twice (layers 1 and 2)", nn.Pipe, nn.Sequential(lin, lin))
    fails("placement names workers (worker1): call rpc.init_rpc before making the Pipe", nn.Pipe, seq,
      {placement = {"worker1"}})
    fails("placement[1] is \"worker1/gpu\": the device after '/' must be cpu, cuda or cuda:N", nn.Pipe, seq,
      {placement = {"worker1/gpu"}})
    local pipe = nn.Pipe(seq, {chunks = 4, balance = {2, 3}})
    assert.are.equal(0, max_diff(seq:get(3).weight, pipe:state_dict()["partitions.1.0.weight"]))
    fails("the input has no tensor to cut into micro-batches (got number, string)", pipe, 3, "x")
    fails("the inputs cut into different numbers of micro-batches (4 and 2)", pipe, x, tensor.randn(2, 1))
    fails("loss_fn must be a function or a loss module, got nil", pipe.train_step, pipe, x, x)
    fails("the input cuts into 4 micro-batches but the target into 3", pipe.train_step, pipe, x,
      tensor.randn(6, 3, f64), nn.MSELoss())
    fails("loss_reduction must be \"mean\" or \"sum\", got none", pipe.train_step, pipe, x, x, nn.MSELoss(),
      {loss_reduction = "none"})
    fails("the loss function gave a tensor of size Size([2, 3]) for micro-batch 1", pipe.train_step, pipe, x,
      tensor.randn(8, 3, f64), function(o) return o end)
    fails("the Pipe places its stages itself", pipe.to, pipe, "cpu")
    local out = pipe(x)
    fails("RPC is not initialised in this process, so this RRef has no owner name", out.owner_name, out)
  end)
end)

describe("nn.Pipe across workers #world", function()
  it("gives the plain model's output and gradients on 1, 2 and 4 workers, every checkpoint mode, both schedules",
    function()
    local r = S.checked_world(4, [[
      local tensor = require "tensor"
      local nn = require "nn"
      local optim = require "optim"
      local dist_autograd = require "dist_autograd"
      local f64 = {dtype = tensor.float64}
      rpc.enable_tracing(os.getenv("RPCHOST_SPEC_TMPDIR") .. "/pipe-" .. rank .. ".trace")
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      -- on an owner: the context's gradients of the parameters behind these RRefs
      function grads_of(ctx, refs)
        local g = dist_autograd.get_gradients(ctx)
        local out = {}
        for i, r in ipairs(refs) do out[i] = g[r:local_value()] end
        return out
      end
      function value_of(r) return r:local_value():detach():clone() end
      -- on a stage's worker: the phases of one run's events, in order ("F1 F2 B1 ...")
      function ops_of(id, step, j)
        local out = {}
        for _, e in ipairs(require("rpchost.trace").events()) do
          local a = e.args
          if e.cat == "pipe" and a.pipe == id and a.step == step and a.stage == j then
            out[#out + 1] = (a.phase == "forward" and "F" or "B") .. a.micro
          end
        end
        return table.concat(out, " ")
      end
      local function max_diff(a, b) return (a - b):abs():max():item() end
      local function remote_grads(ctx, refs)
        local out = {}
        for i, r in ipairs(refs) do out[i] = rpc.rpc_sync(r:owner_name(), grads_of, {ctx, {r}})[1] end
        return out
      end
      if rank == 0 then
        tensor.manual_seed(1)
        local seq = nn.Sequential(nn.Linear(4, 8, f64), nn.Tanh(), nn.Linear(8, 8, f64), nn.ReLU(),
          nn.Linear(8, 3, f64))
        local x, y = tensor.randn(10, 4, f64), tensor.randn(10, 3, f64)
        local mse = nn.MSELoss()
        local out = seq(x)
        local loss = mse(out, y)
        loss:backward()
        local want = {}
        for i, p in ipairs(seq:parameters()) do want[i] = p.grad:clone() end
        seq:zero_grad()
        local placements = {{"w1"}, {"w1", "w2"}, {"w0", "w1", "w2", "w3"}}
        local ok_out, ok_grads, ok_train = true, true, true
        for _, pl in ipairs(placements) do
          for _, ck in ipairs{"never", "except_last", "always"} do
            local pipe = nn.Pipe(seq, {chunks = 4, placement = pl, checkpoint = ck})
            local refs = pipe:parameter_rrefs()
            dist_autograd.context(function(ctx)
              local got = pipe(x):to_here()
              ok_out = ok_out and max_diff(got, out) < 1e-12
              dist_autograd.backward(ctx, {mse(got, y)})
              for i, g in ipairs(remote_grads(ctx, refs)) do ok_grads = ok_grads and max_diff(g, want[i]) < 1e-12 end
            end)
            for _, sch in ipairs{"gpipe", "1f1b"} do
              local p2 = nn.Pipe(seq, {chunks = 4, placement = pl, checkpoint = ck, schedule = sch})
              local refs2 = p2:parameter_rrefs()
              dist_autograd.context(function(ctx)
                local l = p2:train_step(x, y, mse)
                ok_train = ok_train and math.abs(l - loss:item()) < 1e-12
                for i, g in ipairs(remote_grads(ctx, refs2)) do
                  ok_train = ok_train and max_diff(g, want[i]) < 1e-12
                end
              end)
              if #pl == 4 and ck == "never" then
                local id, step = p2:last_run()
                local order = rpc.rpc_sync("w1", ops_of, {id, step, 2})
                local expect = sch == "gpipe" and "F1 F2 F3 F4 B4 B3 B2 B1" or "F1 F2 F3 B1 F4 B2 B3 B4"
                check("stage 2's ops in " .. sch .. " order", order == expect, order)
              end
            end
          end
        end
        check("outputs equal the plain model's", ok_out)
        check("gradients through dist_autograd equal the plain model's", ok_grads)
        check("train_step's losses and gradients equal the plain model's", ok_train)
        -- a DistributedOptimizer steps the stages where they live, as SGD steps the plain model
        local pipe = nn.Pipe(seq, {chunks = 3, placement = {"w1", "w2", "w3"}, schedule = "1f1b"})
        local refs = pipe:parameter_rrefs()
        local opt = rpc.DistributedOptimizer(optim.SGD, refs, {lr = 0.1})
        dist_autograd.context(function(ctx)
          pipe:train_step(x, y, mse)
          opt:step(ctx)
        end)
        local stepped = true
        for i, p in ipairs(seq:parameters()) do
          local now = rpc.rpc_sync(refs[i]:owner_name(), value_of, {refs[i]})
          stepped = stepped and max_diff(now, p - want[i] * 0.1) < 1e-12
        end
        check("DistributedOptimizer steps every stage on its worker", stepped)
        local sd, ps = pipe:state_dict(), seq:parameters()
        check("state_dict gathers the stages' weights under PyTorch's Pipe's names",
          max_diff(sd["partitions.0.0.weight"], ps[1] - want[1] * 0.1) < 1e-12 and
          max_diff(sd["partitions.2.0.bias"], ps[6] - want[6] * 0.1) < 1e-12, sd)
      end
      rpc.shutdown()
    ]], {timeout = 120})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("stops every stage when one fails, names it, and runs again after; refuses what cannot work", function()
    local r = S.checked_world(3, [[
      local tensor = require "tensor"
      local nn = require "nn"
      local dist_autograd = require "dist_autograd"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      -- fails on a micro-batch holding a huge value
      Boom = nn.Module:extend("Boom")
      function Boom:forward(x)
        if x:abs():max():item() > 1e6 then error("a huge activation") end
        return x
      end
      -- takes 1.5 s over a micro-batch holding a huge value
      Slow = nn.Module:extend("Slow")
      function Slow:forward(x)
        if x:abs():max():item() > 1e6 then rpc.sleep(1.5) end
        return x
      end
      if rank == 0 then
        local seq = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 2))
        local pipe = nn.Pipe(seq, {chunks = 4, placement = {"w1", "w2", "w1"}})
        local x = tensor.randn(8, 4)
        x[6] = 1e9
        local t0 = rpc.time()
        local failed, e = raises(function() return pipe(x):to_here() end)
        check("a stage's error names the stage, its worker and the micro-batch", failed and
          tostring(e):find("nn.Pipe: stage 2 of 3 (on w2) failed in the forward of micro-batch 3", 1, true) and
          tostring(e):find("a huge activation", 1, true), e)
        check("the other stages stop at once", rpc.time() - t0 < 5, rpc.time() - t0)
        failed, e = raises(function()
          return dist_autograd.context(function() return pipe:train_step(x, tensor.zeros(8, 2), nn.MSELoss()) end)
        end)
        check("a failing train_step too", failed and tostring(e):find("stage 2 of 3 (on w2) failed", 1, true), e)
        x[6] = 1
        check("the pipe runs again after", pipe(x):to_here():size(1) == 8)
        local slow = nn.Pipe(nn.Sequential(Slow(), nn.Linear(4, 2)), {chunks = 4, placement = {"w1", "w2"},
          timeout = 0.5})
        x[6] = 1e9
        t0 = rpc.time()
        failed, e = raises(function() return slow(x):to_here() end)
        check("a stage waiting past the timeout says for what and from whom", failed and tostring(e):find(
          "stage 2 waited 0.5 s for the activation of micro-batch 3 from stage 1 (w1)", 1, true) and
          rpc.time() - t0 < 1.4, e)
        x[6] = 1
        failed, e = raises(pipe.train_step, pipe, x, tensor.zeros(8, 2), nn.MSELoss())
        check("train_step across workers needs a context", failed and
          tostring(e):find("call it inside dist_autograd.context", 1, true), e)
        failed, e = raises(nn.Pipe, seq, {placement = {"w1", "w9", "w2"}})
        check("an unknown worker", failed and tostring(e):find("placement[2]: unknown worker 'w9'", 1, true), e)
        local shared = nn.Linear(4, 4)
        failed, e = raises(nn.Pipe, nn.Sequential(shared, nn.Sequential(shared)), {placement = {"w1", "w2"}})
        check("a parameter shared across workers", failed and
          tostring(e):find("a parameter is shared by layers of stages 1 and 2", 1, true), e)
        failed, e = raises(pipe.parameters, pipe)
        check("parameters live on the workers", failed and tostring(e):find("use parameter_rrefs()", 1, true), e)
        -- a BatchNorm on a worker keeps the mini-batch's running statistics
        tensor.manual_seed(4)
        local plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        local bnpipe = nn.Pipe(nn.deepcopy(plain), {chunks = 4, placement = {"w1", "w2"},
          deferred_batch_norm = true})
        local xb = tensor.randn(16, 3)
        plain(xb)
        bnpipe(xb):to_here()
        local sd = bnpipe:state_dict()
        check("deferred BatchNorm on a worker", (sd["partitions.1.0.running_var"] - plain:get(2).running_var):abs()
          :max():item() < 1e-6 and sd["partitions.1.0.num_batches_tracked"]:item() == 1, sd)
      end
      rpc.shutdown()
    ]], {timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
end)
