-- Tracing and counters: RPCHOST_TRACE under the launcher gives one merged Chrome
-- trace with calls, handlers, collectives and store waits of every rank; rpc.stats
-- counts calls per peer with a latency histogram.
local S = require "spec.support"

describe("tracing #world", function()
  it("writes one merged Chrome trace for the world", function()
    local path = S.tmpdir .. "/world_trace.json"
    os.remove(path)
    local r = S.world(2, S.prelude .. [[
      local tensor = require "tensor"
      function add(a, b) return a + b end
      dist.init_process_group{backend = "gloo"}
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then for i = 1, 3 do rpc.rpc_sync("w1", add, {i, 1}) end end
      local t = tensor.ones(4)
      dist.all_reduce(t)
      rpc.shutdown()
      dist.destroy_process_group()
    ]], {env = {RPCHOST_TRACE = path}})
    assert.are.equal(0, r.status, r.err)
    assert.is_nil(io.open(path .. ".rank0"), "per-rank files are merged away")
    local check = S.write(([==[
import json, sys
d = json.load(open("%s"))
ev = [e for e in d["traceEvents"] if e.get("ph") == "X"]
names = {(e["pid"], e["cat"], e["name"].split(" ")[0]) for e in ev}
need = {(0, "rpc", "call"), (1, "rpc", "run"), (0, "collective", "all_reduce"),
        (1, "collective", "all_reduce"), (0, "store", "store"), (1, "store", "store")}
missing = need - names
calls = [e for e in ev if e["name"] == "call add"]
assert not missing, missing
assert len(calls) == 3 and all(e["dur"] >= 0 and e["args"]["to"] == "w1" for e in calls), calls
meta = [e for e in d["traceEvents"] if e.get("ph") == "M"]
assert {m["args"]["name"] for m in meta} == {"w0", "w1"}, meta
print("trace ok")
]==]):format(path), "check_trace.py")
    local p = io.popen("python3 " .. check .. " 2>&1")
    local out = p:read("*a")
    p:close()
    assert.truthy(out:find("trace ok", 1, true), out)
  end)

  it("counts calls per peer with a latency histogram", function()
    local r = S.world(2, S.prelude .. [[
      function echo(x) return x end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        for i = 1, 10 do rpc.rpc_sync("w1", echo, {i}) end
        pcall(rpc.rpc_sync, "w1", error, {"boom"})
        local s = rpc.stats()
        local p = s.peers.w1
        local n = 0
        for _, c in pairs(p.latency_us) do n = n + c end
        check("calls counted", p.calls_out == 11 and p.errors == 1 and n == 11, p.calls_out)
        check("bytes counted", s.bytes_out > 0 and s.bytes_in > 0 and p.bytes_out > 0 and p.bytes_in > 0
          and p.bytes_out <= s.bytes_out, p.bytes_out)
        local remote = rpc.rpc_sync("w1", function() return rpc.stats().peers.w0.calls_in end)
        check("incoming counted", remote == 12)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)
end)
