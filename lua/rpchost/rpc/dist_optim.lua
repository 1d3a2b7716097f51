-- rpchost.rpc.dist_optim: rpc.DistributedOptimizer. One local optimizer per owner of
-- the parameters (created there, behind an RRef); step(ctx_id) makes each owner
-- apply the gradients its distributed autograd context holds, all in parallel.
-- Construction waits until every owner made its optimizer (errors show there).
local M = {}
local DO = {}
DO.__index = DO

function M.create(optim_ctor, rrefs, opts)
  local params = {}
  for i, r in ipairs(rrefs) do params[i] = r:local_value() end
  return optim_ctor(params, opts)
end

function M.step(opt_rref, ctx_id)
  local grads = require("rpchost.rpc.dist_autograd")._grads(ctx_id)
  opt_rref:local_value():step(grads)
  return true
end

function M.new(optim_ctor, param_rrefs, opts)
  local rpc = require "rpchost.rpc"
  if type(optim_ctor) ~= "function" and not (type(optim_ctor) == "table" and getmetatable(optim_ctor)
      and getmetatable(optim_ctor).__call) then
    error(require("rpchost.errors").new("config", ("DistributedOptimizer: expected an optimizer constructor " ..
      "such as optim.SGD, got %s"):format(type(optim_ctor))), 2)
  end
  if type(param_rrefs) ~= "table" then
    error(require("rpchost.errors").new("config", ("DistributedOptimizer: expected a list of parameter RRefs, " ..
      "got %s"):format(type(param_rrefs))), 2)
  end
  local by_owner, order = {}, {}
  for i, r in ipairs(param_rrefs) do
    if not rpc.is_rref(r) then error(("DistributedOptimizer: parameter %d is not an RRef"):format(i), 2) end
    local o = r:owner_name()
    if not by_owner[o] then by_owner[o] = {}; order[#order + 1] = o end
    table.insert(by_owner[o], r)
  end
  local self = setmetatable({remotes = {}}, DO)
  for _, owner in ipairs(order) do
    self.remotes[#self.remotes + 1] = rpc.remote(owner, M.create, {optim_ctor, by_owner[owner], opts})
  end
  -- as PyTorch's, construction waits for every local optimizer: a constructor
  -- error (a bad option, say) is raised here, not at the first step()
  local rref = require "rpchost.rpc.rref"
  for _, r in ipairs(self.remotes) do rref.wait_created(r) end
  return self
end

function DO:step(ctx_id)
  local rpc = require "rpchost.rpc"
  local futs = {}
  for i, r in ipairs(self.remotes) do futs[i] = rpc.rpc_async(r:owner(), M.step, {r, ctx_id}) end
  rpc.wait_all(futs)
end

return M
