-- rpc.RemoteModule over real processes: forward and forward_async run the
-- owner's module and give what the same module gives locally; remote_parameters
-- are RRefs owned there that DistributedOptimizer steps inside a dist_autograd
-- context; bad devices and bad constructors are clear errors at construction.
local S = require "spec.support"

describe("rpc.RemoteModule #world", function()
  it("forwards, trains through DistributedOptimizer, and refuses bad input", function()
    local r = S.checked_world(2, [[
      local tensor = require "tensor"
      local nn = require "nn"
      local optim = require "optim"
      local dist_autograd = require "dist_autograd"
      function read_weight(ref) return ref:local_value().weight:detach():clone() end
      function read_bias(ref) return ref:local_value().bias:detach():clone() end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        tensor.manual_seed(3)
        local m = rpc.RemoteModule("w1/cpu", nn.Linear, {3, 2})
        local w = rpc.rpc_sync("w1", read_weight, {m:get_module_rref()})
        local b = rpc.rpc_sync("w1", read_bias, {m:get_module_rref()})
        local x = tensor.randn(4, 3)
        local want = x:matmul(w:t()) + b
        check("forward", (m:forward(x) - want):abs():max():item() < 1e-5)
        check("call", (m(x) - want):abs():max():item() < 1e-5)
        check("forward_async", (m:forward_async(x):wait() - want):abs():max():item() < 1e-5)
        local ps = m:remote_parameters()
        check("parameter rrefs", #ps == 2 and ps[1]:owner_name() == "w1" and ps[1]:confirmed_by_owner() ~= nil)
        local opt = rpc.DistributedOptimizer(optim.SGD, ps, {lr = 0.1})
        local g
        dist_autograd.context(function(ctx)
          local loss = m(x):sum()
          dist_autograd.backward(ctx, {loss})
          opt:step(ctx)
        end)
        -- d(sum(x W^T + b))/dW = column sums of x, for each output row
        local gw = x:sum(1):view(1, 3):expand(2, 3)
        local w2 = rpc.rpc_sync("w1", read_weight, {m:get_module_rref()})
        check("stepped on the owner", (w2 - (w - gw * 0.1)):abs():max():item() < 1e-5, w2)
        local ok, e = pcall(m.parameters, m)
        check("no local parameters", not ok and tostring(e):find("remote_parameters", 1, true), e)
        ok, e = pcall(rpc.RemoteModule, "w1/gpu", nn.Linear, {3, 2})
        check("bad device", not ok and tostring(e):find("cpu, cuda or cuda:N", 1, true), e)
        ok, e = pcall(rpc.RemoteModule, "w1", 42, {})
        check("bad class", not ok and tostring(e):find("module class", 1, true), e)
        ok, e = pcall(rpc.RemoteModule, "w1", nn.Linear, {"three", 2})
        check("constructor error at construction", not ok and tostring(e):find("Linear(in_features", 1, true), e)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
end)
