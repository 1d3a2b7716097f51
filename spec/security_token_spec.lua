-- What proves a world, as users set it (issue 31): the security_token option
-- works under `rpchost run` as RPCHOST_TOKEN does; the token is no MAC key
-- itself, so "abc" and "abc\0", or a long token and its SHA-256, are different
-- tokens; an empty token is refused, never taken as none; and a world secret
-- that cannot be written (a full disk) is said so, with nothing left behind.
local S = require "spec.support"
local D = require "spec.documented"
local core = require "rpchost.core"

local function unhex(h) return (h:gsub("%x%x", function(x) return string.char(tonumber(x, 16)) end)) end

describe("security tokens, as users set them #world", function()
  it("the security_token option works under rpchost run, and its world is proven by it", function()
    local r = S.world(2, S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{security_token = "option-token"}})
      local a = rpc._agent()
      check("the agents prove the token", a.cred and a.cred.kind == "token", a.cred and a.cred.kind)
      if rank == 0 then
        local offset = 10
        check("a closure by value runs (a proven world)", rpc.rpc_sync("w1", function(x) return x + offset end,
          {1}) == 11)
      end
      rpc.shutdown()
    ]], {unset = {"RPCHOST_TOKEN", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
    assert.is_nil(r.err:find("unset RPCHOST_TOKEN", 1, true), r.err)
  end)

  -- (issue 33: with RPCHOST_TOKEN also exported, the launcher's store proved
  -- the variable's token and refused the rank's "security token differs")
  it("an option that differs from RPCHOST_TOKEN is named at once, under rpchost run; the same one works", function()
    local script = S.write(S.prelude .. [[
      local ok, e = pcall(rpc.init_rpc, "w" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{security_token = "option-token"}})
      if not ok then print("refused " .. tostring(e.kind) .. ": " .. tostring(e.message)) os.exit(0) end
      if rank == 0 then check("one token: a call", rpc.rpc_sync("w1", math.max, {1, 2}) == 2) end
      rpc.shutdown()
    ]])
    local t0 = S.now()
    local differ = S.run({"run", "--nproc-per-node", "2", script}, {env = {RPCHOST_TOKEN = "variable-token"},
      timeout = 30})
    assert.are.equal(0, differ.status, differ.out .. differ.err)
    assert.is_true(S.now() - t0 < 10)
    assert.truthy(differ.out:find("refused config: security_token differs from RPCHOST_TOKEN, which is also set",
      1, true), differ.out .. differ.err)
    assert.truthy(differ.out:find("unset RPCHOST_TOKEN", 1, true), differ.out)
    local same = S.run({"run", "--nproc-per-node", "2", script}, {env = {RPCHOST_TOKEN = "option-token"},
      timeout = 30})
    assert.are.equal(0, same.status, same.out .. same.err)
    S.assert_checks(same)
  end)

  -- rank 1 holds a token that HMAC would have taken for rank 0's as a key
  local function mismatched(token0, token1)
    return S.world(2, S.prelude .. [[
      local t = rank == 0 and ]] .. ("%q"):format(token0) .. [[ or ]] .. ("%q"):format(token1) .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{security_token = t}})
      if rank == 0 then
        local ok, e = pcall(rpc.rpc_sync, "w1", math.max, {1, 2})
        check("the other token is refused", not ok and e.kind == "auth" and
          tostring(e):find("security token differs", 1, true) ~= nil, tostring(e))
        rpc._agent().store:set("done", "1")
      else
        rpc._agent().store:wait({"done"}, 20)
      end
      os.exit(0)
    ]], {unset = {"RPCHOST_TOKEN", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}, timeout = 60})
  end

  it("are not padded: 'abc' and 'abc\\0' are different tokens", function()
    local r = mismatched("abc", "abc\0")
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("are not hashed into their own SHA-256 when long", function()
    local long = ("a long token, longer than a SHA-256 block of sixty-four bytes: "):rep(2)
    local r = mismatched(long, unhex(core.sha256_hex(long)))
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("refuse an empty token, by variable or option, instead of opening the world", function()
    local script = S.write(S.prelude .. [[
      local ok, e = pcall(rpc.init_rpc, "w0", {rank = 0, world_size = 1, rpc_backend_options =
        rpc.TensorPipeRpcBackendOptions{security_token = os.getenv("AS_OPTION") and "" or nil}})
      print(ok and "JOINED" or ("refused " .. tostring(e.kind) .. ": " .. tostring(e.message)))
      if ok then rpc.shutdown() end
    ]])
    local base = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = S.free_port()}
    local e = {RPCHOST_TOKEN = ""}
    for k, v in pairs(base) do e[k] = v end
    local env_var = S.run({script}, {env = e, timeout = 20})
    assert.truthy(env_var.out:find("refused config: ", 1, true) and
      env_var.out:find("RPCHOST_TOKEN is set but empty", 1, true), env_var.out .. env_var.err)
    local o = {AS_OPTION = "1", MASTER_ADDR = "127.0.0.1", MASTER_PORT = S.free_port()}
    local option = S.run({script}, {env = o, timeout = 20})
    assert.truthy(option.out:find("refused config: security_token is empty", 1, true), option.out .. option.err)
    -- and under the launcher, whose store reads it first
    local launched = S.run({"run", "--nproc-per-node", "1", script}, {env = {RPCHOST_TOKEN = ""}, timeout = 20})
    assert.are_not.equal(0, launched.status)
    assert.truthy((launched.out .. launched.err):find("RPCHOST_TOKEN is set but empty", 1, true),
      launched.out .. launched.err)
  end)

  it("a world secret that cannot be written (a full disk) is said so, and nothing is left behind", function()
    if core.getuid() ~= 0 then
      pending("needs root to mount a small full tmpfs in a mount namespace")
      return
    end
    local dir = S.tmpdir .. ("/full-%d"):format(math.random(1e9))
    os.execute("mkdir -p " .. dir)
    local script = S.write(S.prelude .. [[
      rpc.init_rpc("w0", {rank = 0, world_size = 1})
      print("JOINED")
      rpc.shutdown()
    ]])
    local shell = 'mount -t tmpfs -o size=64k tmpfs "$D" || exit 77; mkdir -m 700 "$D/rpchost" "$D/rpchost/bytecode"; ' ..
      'head -c 1000000 /dev/zero > "$D/fill" 2>/dev/null; "$@"; rc=$?; ' ..
      'for f in "$D"/rpchost/world-*; do [ -e "$f" ] && echo "LEFT: $f $(stat -c %s "$f")"; done; exit $rc'
    local r = S.run({script}, {prefix = {"unshare", "-m", "--propagation", "private", "sh", "-c", shell, "sh"},
      env = {D = dir, XDG_RUNTIME_DIR = dir, MASTER_ADDR = "127.0.0.1", MASTER_PORT = S.free_port()},
      unset = {"RPCHOST_TOKEN", "RANK", "WORLD_SIZE"}, timeout = 30})
    local all = r.out .. r.err
    assert.are_not.equal(77, r.status, "could not mount a tmpfs: " .. all)
    assert.are_not.equal(0, r.status, all)
    assert.is_nil(all:find("JOINED", 1, true), all)
    assert.truthy(all:find("No space left on device", 1, true), all)
    assert.truthy(all:find("the disk is full", 1, true), all)
    -- (in the words docs/troubleshooting.md quotes)
    D.message(all, [[cannot write the world's secret ...: ...No space left on device ... (the disk is full: ...)]])
    assert.is_nil(all:find("LEFT:", 1, true), all)
    assert.is_true(r.elapsed < 20, all)
  end)
end)
