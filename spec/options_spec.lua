-- Every options table of the API refuses a key it does not know, the same way:
-- "<name> has no option '<key>' (options: ...)", naming the nearest key when
-- one looks misspelt (docs/troubleshooting.md), instead of ignoring it.
local S = require "spec.support"

describe("options tables #unit", function()
  local rpc, dist = require "rpc", require "dist"
  local data = require("tensor").data

  local function refused(fn, ...)
    local ok, e = pcall(fn, ...)
    assert.is_false(ok)
    return tostring(type(e) == "table" and e.message or e)
  end

  it("init_rpc names a misspelt key and where a backend option goes", function()
    local m = refused(rpc.init_rpc, "w", {rank = 0, world_size = 1, rpc_timout = 3})
    assert.truthy(m:find("init_rpc has no option 'rpc_timout', did you mean 'rpc_timeout'? (options: backend, rank, " ..
      "rpc_backend_options, rpc_timeout, world_size)", 1, true), m)
    m = refused(rpc.init_rpc, "w", {rank = 0, world_size = 1, num_worker_thread = 3})
    assert.truthy(m:find("'num_worker_threads' is an option of rpc.TensorPipeRpcBackendOptions{...}", 1, true), m)
    m = refused(rpc.init_rpc, "w", {rank = 0, wrld_size = 1})
    assert.truthy(m:find("init_rpc has no option 'wrld_size', did you mean 'world_size'?", 1, true), m)
  end)

  it("init_process_group, DataLoader and DistributedSampler refuse what they do not know", function()
    local m = refused(dist.init_process_group, {backend = "gloo", rank = 0, world_size = 1, timout = 5})
    assert.truthy(m:find("init_process_group has no option 'timout', did you mean 'timeout'?", 1, true), m)
    local ds = data.TensorDataset(require("tensor").zeros(4, 2))
    m = refused(data.DataLoader, ds, {batchsize = 2})
    assert.truthy(m:find("DataLoader has no option 'batchsize', did you mean 'batch_size'?", 1, true), m)
    m = refused(data.DistributedSampler, ds, {num_replica = 2, rank = 0})
    assert.truthy(m:find("DistributedSampler has no option 'num_replica', did you mean 'num_replicas'?", 1, true), m)
    local s = data.DistributedSampler(ds, {num_replicas = 2, rank = 1})
    assert.are.equal(2, #s)
  end)
end)
