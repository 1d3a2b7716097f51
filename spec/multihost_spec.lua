-- Several hosts: three network namespaces on a private test subnet (made here,
-- torn down after), one rank in each. Needs root and `ip`; skipped otherwise,
-- with the reason. A link is cut and restored: calls fail while it is down and
-- work again after, without restarting anything.
local S = require "spec.support"

local NS = {"rhspec-n1", "rhspec-n2", "rhspec-n3"}
local BR = "rhspec-br"
local IP = {"10.213.7.1", "10.213.7.2", "10.213.7.3"}

local function sh(cmd) return os.execute(cmd .. " >/dev/null 2>&1") == 0 end

local function teardown_net()
  for _, n in ipairs(NS) do sh("ip netns del " .. n) end
  sh("ip netns del " .. BR)
end

local function setup_net()
  teardown_net()
  local ok = sh("ip netns add " .. BR) and sh("ip -n " .. BR .. " link add br0 type bridge")
    and sh("ip -n " .. BR .. " link set br0 up")
  for i, n in ipairs(NS) do
    ok = ok and sh("ip netns add " .. n)
      and sh(("ip link add rhv%d type veth peer name rhb%d"):format(i, i))
      and sh(("ip link set rhv%d netns %s name eth0"):format(i, n))
      and sh(("ip link set rhb%d netns %s"):format(i, BR))
      and sh(("ip -n %s link set rhb%d master br0 up"):format(BR, i))
      and sh(("ip -n %s addr add %s/24 dev eth0"):format(n, IP[i]))
      and sh(("ip -n %s link set eth0 up"):format(n))
      and sh(("ip -n %s link set lo up"):format(n))
  end
  return ok
end

local available, why = true, nil
if os.getenv("USER") ~= "root" and io.popen("id -u"):read("*l") ~= "0" then
  available, why = false, "needs root for network namespaces"
elseif not sh("command -v ip") then
  available, why = false, "needs the ip command (iproute2)"
end

describe("multi-host worlds (network namespaces) #world", function()
  setup(function()
    if available and not setup_net() then
      available, why = false, "could not create network namespaces here"
      teardown_net()
    end
  end)
  teardown(function() if available then teardown_net() end end)

  local function start_world(script, env)
    local path = S.write(script)
    local hs = {}
    for i = 1, 3 do
      local e = {RANK = i - 1, WORLD_SIZE = 3, MASTER_ADDR = IP[1], MASTER_PORT = 29517,
                 RPCHOST_INIT_TIMEOUT = 20, RPCHOST_STORE_LINGER = 1}
      -- (a variable given as false is unset: an empty RPCHOST_TOKEN is an error, not "none")
      local unset = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "RPCHOST_STORE_HOSTED", "RPCHOST_ERROR_FILE"}
      for k, v in pairs(env or {}) do
        if v == false then unset[#unset + 1] = k else e[k] = v end
      end
      hs[i] = S.start({path}, {env = e, unset = unset, prefix = {"/usr/sbin/ip", "netns", "exec", NS[i]}})
    end
    return hs
  end

  it("runs a world across hosts, and calls work again after a link is cut and restored", function()
    if not available then pending(why) return end
    local flag = S.tmpdir .. "/link_restored"
    os.remove(flag)
    local hs = start_world(S.prelude .. ([[
      local sched = require "rpchost.sched"
      function where() return rpc.get_worker_info().name end
      rpc.init_rpc("host" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        check("call across hosts", rpc.rpc_sync("host1", where) == "host1" and rpc.rpc_sync("host2", where) == "host2")
        local offset = 1
        check("closure in an authenticated world", rpc.rpc_sync("host2", function(x) return x + offset end, {1}) == 2)
        print("CUT NOW")
        io.stdout:flush()
        sched.sleep(0.5)
        local ok = pcall(rpc.rpc_sync, "host1", where, nil, nil, 0.5)
        check("fails while cut", not ok)
        -- wait for the spec to restore the link, then call again
        local t0 = sched.now()
        wait_until(function() return io.open("%s") end, 20, "the spec to restore the link", 0.1)
        local tries = 0
        local back = wait_until(function()
          local ok, err = pcall(rpc.rpc_sync, "host1", where, nil, nil, 1)
          tries = tries + 1
          if not ok and tries <= 3 then print("retry: " .. tostring(err)) end
          return ok
        end, 25 - (sched.now() - t0), "a call to host1 to work again")
        check("works again after restore", back)
      end
      rpc.shutdown(true, 30)
    ]]):format(flag), {RPCHOST_TOKEN = "multi-host-secret"})
    S.wait_until(function() return table.concat(hs[1].out):find("CUT NOW", 1, true) end, 30,
      function() return "rank 0 to say CUT NOW:\n" .. table.concat(hs[1].err) end, 0.05)
    assert.is_true(sh("ip -n " .. NS[2] .. " link set eth0 down"))
    S.sleep(1.5)
    assert.is_true(sh("ip -n " .. NS[2] .. " link set eth0 up"))
    io.open(flag, "w"):close()
    local r = {}
    for i = 1, 3 do r[i] = hs[i]:wait(60) end
    S.assert_checks(r, {on = 1})
    for i = 1, 3 do assert.are.equal(0, r[i].status, r[i].err) end
  end)

  it("refuses closures in a world that is neither loopback-only nor authenticated", function()
    if not available then pending(why) return end
    local hs = start_world(S.prelude .. [[
      rpc.init_rpc("host" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local ok, e = pcall(rpc.rpc_sync, "host1", function() return 1 end)
        check("closure refused", not ok and tostring(e.message):find("refused", 1, true), e)
        check("by name still works", rpc.rpc_sync("host1", math.max, {1, 2}) == 2)
      end
      rpc.shutdown(true, 30)
    ]], {RPCHOST_TOKEN = false})
    local r = {}
    for i = 1, 3 do r[i] = hs[i]:wait(60) end
    S.assert_checks(r, {on = 1})
    assert.truthy(r[1].err:find("without a security token", 1, true), r[1].err)
  end)
end)
