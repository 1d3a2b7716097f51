-- `rpchost run --standalone`: torchrun's flag for a one-node world with its own
-- rendezvous on a free port (issue 33), and the options that contradict it.
local S = require "spec.support"

describe("rpchost run --standalone #world", function()
  it("makes a one-node world on a free port, as torchrun's flag does", function()
    local r = S.world(2, [[
      local rpc = require "rpc"
      local rank = tonumber(os.getenv "RANK")
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2})
      if rank == 0 then print("sum " .. rpc.rpc_sync("w1", math.max, {3, 9})) end
      print(os.getenv "MASTER_ADDR", os.getenv "WORLD_SIZE")
      rpc.shutdown()
    ]], {launcher_args = {"--standalone", "--nnodes", "1"}, timeout = 30})
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("sum 9", 1, true), r.out)
    assert.truthy(r.out:find("127.0.0.1\t2", 1, true), r.out)
  end)

  it("refuses the options that contradict it, naming them", function()
    local path = S.write("print('ran')")
    for _, case in ipairs {
      {{"--nnodes", "2"}, "--standalone makes a one-node world: leave out --nnodes 2"},
      {{"--node-rank", "1", "--nnodes", "2"}, "--standalone makes a one-node world: leave out --nnodes 2"},
      {{"--master-port", "29999"}, "leave out --master-port"},
      {{"--master-addr", "10.0.0.1"}, "leave out --master-addr"},
    } do
      local args = {"run", "--standalone"}
      for _, a in ipairs(case[1]) do args[#args + 1] = a end
      args[#args + 1] = path
      local r = S.run(args, {timeout = 20})
      assert.are.equal(2, r.status, r.err)
      assert.truthy(r.err:find(case[2], 1, true), r.err)
      assert.is_nil(r.out:find("ran", 1, true))
    end
  end)
end)
