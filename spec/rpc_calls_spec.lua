-- The forms and failures of a call, as a PyTorch RPC user meets them (issue 33):
-- completing a Future twice, every timeout of kind timeout (the RRef proxies',
-- remote()'s to oneself), the fourth argument always kwargs and args always a
-- list, timeouts that name the function and the callee, rref:backward()'s
-- return and init_rpc's positional habit.
local S = require "spec.support"

local function world(n, body, opts)
  local r = S.world(n, S.prelude .. [[
    local sched = require "rpchost.sched"
    function slow(s) sched.sleep(s) return s end
    function echo(...) return select("#", ...), ... end
    Obj = {}
    Obj.__index = Obj
    function Obj.new(delay) if delay then sched.sleep(delay) end return setmetatable({n = 1}, Obj) end
    function Obj:slow(s) sched.sleep(s) return s end
    function Obj:quick() return self.n end
    rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
  ]] .. body .. "\nrpc.shutdown()\n", opts)
  assert.are.equal(0, r.status, r.err)
  S.assert_checks(r)
  return r
end

describe("rpc calls #world", function()
  -- PyTorch's test_mark_future_twice
  it("raises when the program completes a Future that is complete, any Future; rpchost's own late completions are silent", function()
    local r = world(2, [[
      if rank == 0 then
        local f = rpc.rpc_async("w1", echo, {1})
        f:wait()
        local ok, e = pcall(f.set_result, f, 1)
        check("set_result on a done rpc_async future raises", not ok and e.kind == "config"
          and tostring(e.message):find("can only be completed once", 1, true), e)
        ok, e = pcall(f.set_error, f, "x")
        check("set_error too", not ok and e.kind == "config", e)
        check("its value stays", select(2, f:wait()) == 1)
        local own = rpc.Future()
        own:set_result(1)
        check("rpc.Future twice raises", not pcall(own.set_result, own, 2) and own:wait() == 1)
        -- the program completes a call's future before the reply: the reply is dropped
        local g = rpc.rpc_async("w1", slow, {0.3})
        g:set_result("mine")
        -- a reply racing its deadline: the late reply is dropped
        local h = rpc.rpc_async("w1", slow, {0.3}, nil, 0.05)
        check("the deadline fails it", not pcall(h.wait, h))
        sched.sleep(0.6)
        check("the program's completion stands", g:wait() == "mine")
        check("the late reply changed nothing", h.state == "error" and h.err.kind == "timeout", h.err)
      end
    ]])
    assert.is_nil(r.err:find("error", 1, true), r.err)
  end)

  -- PyTorch's test_rref_proxy_timeout, to another worker and to oneself
  it("fails RRef proxy calls past their timeout with kind timeout, as every other timeout", function()
    world(2, [[
      if rank == 0 then
        local function call(r, mode, t, method, ...)
          local p = r[mode](r, t)
          local x = p[method](p, ...)
          if mode == "rpc_async" then return x:wait() end
          if mode == "remote" then return x:to_here() end
          return x
        end
        for _, to in ipairs {"w1", "w0"} do
          for _, mode in ipairs {"rpc_sync", "rpc_async", "remote"} do
            -- the method runs past the timeout
            local made = rpc.remote(to, Obj.new, {})
            made:to_here()
            local ok, e = pcall(call, made, mode, 0.2, "slow", 2)
            check("slow method to " .. to .. " by " .. mode, not ok and e.kind == "timeout", e)
            -- the RRef is still being made on its owner when the call comes
            local making = rpc.remote(to, Obj.new, {2})
            ok, e = pcall(call, making, mode, 0.05, "quick")
            check("slow creation to " .. to .. " by " .. mode, not ok and e.kind == "timeout", e)
          end
        end
      end
    ]], {timeout = 90})
  end)

  -- PyTorch's test_udf_remote_message_delay_timeout_to_self
  it("fails a remote() to oneself past its timeout: to_here raises the creation's timeout", function()
    world(2, [[
      if rank == 0 then
        local r = rpc.remote("w0", slow, {1}, nil, 0.2)
        local ok, e = pcall(r.to_here, r)
        check("to_here raises the timeout", not ok and e.kind == "timeout"
          and tostring(e.message):find("was not created on w0 in time", 1, true), e)
        sched.sleep(1.2)
        ok, e = pcall(r.to_here, r)
        check("and still does after the value came", not ok and e.kind == "timeout", e)
        check("local_value too", not pcall(r.local_value, r))
        local fine = rpc.remote("w0", slow, {0.05}, nil, 5)
        check("within its timeout", fine:to_here() == 0.05)
        local peer = rpc.remote("w1", slow, {1}, nil, 0.2)
        ok, e = pcall(peer.to_here, peer)
        check("to another worker as well", not ok and e.kind == "timeout", e)
      end
    ]])
  end)

  it("takes the fourth argument as kwargs always, and refuses an args table that is not a list", function()
    world(2, [[
      if rank == 0 then
        local n, x, kw = rpc.rpc_sync("w1", echo, {1}, {timeout = 5})
        check("{timeout = 5} is kwargs", n == 2 and x == 1 and kw.timeout == 5)
        n, x, kw = rpc.rpc_sync("w1", echo, {1}, {timeout = 5, retries = 3})
        check("{timeout =, retries =} is kwargs", n == 2 and kw.timeout == 5 and kw.retries == 3)
        n, x, kw = rpc.rpc_async("w1", echo, {1}, {timeout = 5}):wait()
        check("rpc_async too", n == 2 and kw.timeout == 5)
        n, x, kw = rpc.remote("w1", echo, {1}, {timeout = 5}):to_here()
        check("remote too", n == 2 and kw.timeout == 5)
        n = rpc.rpc_sync("w1", echo, {args = {1, 2}, timeout = 5})
        check("the options table as the third argument", n == 2)
        n = rpc.rpc_sync("w1", echo, table.pack(1, nil, 3))
        check("a packed list keeps its count", n == 3)
        for name, f in pairs {rpc_sync = rpc.rpc_sync, rpc_async = rpc.rpc_async, remote = rpc.remote} do
          local ok, e = pcall(f, "w1", echo, {x = 1})
          check("{x = 1} refused by " .. name, not ok and e.kind == "config"
            and tostring(e.message):find("args is the list of arguments", 1, true)
            and tostring(e.message):find("'x'", 1, true) and tostring(e.message):find("kwargs, the fourth argument", 1, true), e)
        end
        local ok, e = pcall(rpc.rpc_sync, "w1", echo, {1, 2, y = 3})
        check("a list with a key refused", not ok and e.kind == "config" and tostring(e.message):find("'y'", 1, true), e)
        ok, e = pcall(rpc.rpc_sync, "w1", echo, {timeout = 5, x = 1})
        check("options mixed with a key refused", not ok and e.kind == "config", e)
      end
    ]])
  end)

  it("names the function and the callee in a timeout, and what a Future is for when its wait times out", function()
    world(2, [[
      if rank == 0 then
        local ok, e = pcall(rpc.rpc_sync, "w1", slow, {1}, nil, 0.1)
        check("a global by name", not ok and e.message == "the call of slow on w1 timed out after 0.1 s", e)
        check("no call id in it", not tostring(e.message):find("%d%d%d%d%d"), e)
        local line = debug.getinfo(1, "l").currentline + 1
        local closure = function() sched.sleep(1) end
        ok, e = pcall(rpc.rpc_sync, "w1", closure, {}, nil, 0.1)
        check("a function without a name by where it is defined", not ok and tostring(e.message):find(
          ("the call of a function defined at .-:%d on w1 timed out"):format(line)), e)
        local made = rpc.remote("w1", Obj.new, {})
        ok, e = pcall(function() return made:rpc_sync(0.1):slow(1) end)
        check("a proxy by the method", not ok and tostring(e.message):find(
          "the call of method 'slow' of RRef .- on w1 timed out after 0.1 s"), e)
        local f = rpc.rpc_async("w1", slow, {1})
        ok, e = pcall(f.wait, f, 0.1)
        check("a call's future", not ok and e.kind == "timeout" and tostring(e.message):find(
          "waiting for the call of slow on w1", 1, true), e)
        check("tostring of a call's future", tostring(f):find("the call of slow on w1", 1, true), tostring(f))
        line = debug.getinfo(1, "l").currentline + 1
        local mine = rpc.Future()
        ok, e = pcall(mine.wait, mine, 0.05)
        check("a program's future by where it was made", not ok and tostring(e.message):find(
          ("waiting for rpc%%.Future%%(%%) made at .-:%d"):format(line)), e)
        local own = rpc.RRef(Obj.new())
        ok, e = pcall(function() return own:rpc_sync(0.1):slow(1) end)
        check("a proxy to oneself times out too", not ok and e.kind == "timeout" and tostring(e.message):find(
          "the call of method 'slow' of RRef .- on w0 timed out after 0.1 s"), e)
        f:wait()
      end
    ]])
  end)

  it("returns nothing from rref:backward(), as PyTorch returns None", function()
    world(2, [[
      local tensor = require "tensor"
      function loss() return (tensor.ones(2, {requires_grad = true}) * 3):sum() end
      if rank == 0 then
        local r = rpc.remote("w1", loss, {})
        check("a UserRRef's backward returns nothing", select("#", r:backward()) == 0)
        local own = rpc.RRef(loss())
        check("an OwnerRRef's too", select("#", own:backward()) == 0)
        local dist_autograd = require "dist_autograd"
        dist_autograd.context(function(ctx)
          local d = rpc.remote("w1", loss, {})
          check("with a context, nothing", select("#", d:backward(ctx)) == 0)
        end)
      end
    ]])
  end)

  it("says to pass {rank =, world_size =} for init_rpc(name, rank, world_size)", function()
    local r = S.run({S.write([[
      local rpc = require "rpc"
      local ok, e = pcall(rpc.init_rpc, "w0", 0, 2)
      print(ok, e.kind, e.message)
    ]])}, {timeout = 20})
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("false\tconfig\t", 1, true), r.out)
    assert.truthy(r.out:find("pass rpc.init_rpc(name, {rank = 0, world_size = 2})", 1, true), r.out)
  end)
end)
