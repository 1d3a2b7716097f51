-- PyTorch's test_wait_all_workers_timeout: every worker's graceful shutdown
-- with a timeout too short for the others to arrive fails with its own
-- timeout (never `unreachable` because another worker left first), and the
-- process group the world also holds goes on working afterwards.
local S = require "spec.support"

describe("a graceful shutdown that times out #world", function()
  for _, first in ipairs({"rank 0 leaves first", "the others leave first"}) do
    it("fails with its own timeout on every rank, and the process group goes on (" .. first .. ")", function()
      local r = S.world(3, S.prelude .. [[
        local dist = require "dist"
        local rank = tonumber(os.getenv "RANK")
        dist.init_process_group{backend = "gloo"}
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = 3})
        local late = ]] .. (first == "rank 0 leaves first" and "rank ~= 0" or "rank == 0") .. [[

        if late then rpc.sleep(0.3) end
        local ok, e = pcall(rpc.shutdown, true, 0.01)
        check("shutdown raised", not ok)
        -- (which step of the shutdown it gave up in depends on how far the
        -- others came within 0.01 s: waiting for them to shut down, or, on a
        -- loaded machine, for every rank's count of calls)
        check("its own timeout", type(e) == "table" and e.kind == "timeout"
          and tostring(e.message):find("^shutdown gave up after 0.01 s waiting for ") ~= nil, e)
        local t = require("tensor").ones(1)
        dist.all_reduce(t)
        check("the process group goes on", t:item() == 3)
        dist.destroy_process_group()
      ]], {timeout = 60})
      assert.are.equal(0, r.status, r.out .. r.err)
      S.assert_checks(r)
      assert.is_nil(r.out:find("unreachable", 1, true), r.out)
    end)
  end
end)
