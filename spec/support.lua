-- spec/support.lua: helpers for specs that start real rpchost processes.
-- Specs run inside rpchost (busted --lua=rpchost), so these helpers block the
-- spec's task while the loop runs child processes; every wait is bounded.
local core = require "rpchost.core"
local sched = require "rpchost.sched"

local S = {}

S.bin = os.getenv("RPCHOST_BIN") or core.exepath()
S.root = os.getenv("RPCHOST_SOURCE_DIR") or "."

local tmp_counter = 0
local tmpdir = (os.getenv("TMPDIR") or "/tmp") .. ("/rpchost-spec-%d"):format(core.getpid())
os.execute("mkdir -p " .. tmpdir)
S.tmpdir = tmpdir

-- Writes `text` to a fresh file and returns its path.
function S.write(text, name)
  tmp_counter = tmp_counter + 1
  local path = ("%s/%s"):format(tmpdir, name or ("script%d.lua"):format(tmp_counter))
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  return path
end

-- A port nothing listens on right now.
function S.free_port()
  local l = assert(core.listen("127.0.0.1", 0, {accept = function(c) c:close() end}))
  local p = l:port()
  l:close()
  return p
end

local function merged_env(extra, unset)
  local e = core.environ()
  for _, k in ipairs(unset or {}) do e[k] = nil end
  for k, v in pairs(extra or {}) do e[k] = tostring(v) end
  local l = {}
  for k, v in pairs(e) do l[#l + 1] = k .. "=" .. v end
  return l
end

-- Starts a process; returns a handle with :wait(timeout) -> result table
-- {status, signal, out, err, elapsed, timed_out}. opts: env (extra vars),
-- unset (names to remove), bin (another rpchost), args after the program.
function S.start(args, opts)
  opts = opts or {}
  local h = {out = {}, err = {}, done = false, started = sched.now()}
  -- opts.prefix runs rpchost under another command (ip netns exec NS ...)
  local full = {}
  for _, a in ipairs(opts.prefix or {}) do full[#full + 1] = a end
  full[#full + 1] = opts.bin or S.bin
  for _, a in ipairs(args) do full[#full + 1] = a end
  local file = full[1]
  local unset = opts.unset or {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                               "MASTER_PORT", "RPCHOST_STORE_HOSTED", "RPCHOST_ERROR_FILE"}
  local p, err = core.spawn{
    file = file, args = full, env = merged_env(opts.env, unset), cwd = opts.cwd,
    stdio = {"inherit", "pipe", "pipe"},
    output = function(fd, chunk)
      if chunk then table.insert(fd == 1 and h.out or h.err, chunk) end
    end,
    exit = function(status, signal)
      h.status, h.signal, h.done = status, signal, true
      h.elapsed = sched.now() - h.started
      if h.waiter then sched.wake(h.waiter) end
    end,
  }
  assert(p, err)
  h.proc = p
  h.pid = p:pid()
  function h:wait(timeout)
    timeout = timeout or 60
    local deadline = sched.now() + timeout
    while not self.done and sched.now() < deadline do
      self.waiter = sched.current()
      sched.suspend_until("process " .. tostring(self.pid), deadline - sched.now())
      self.waiter = nil
    end
    if not self.done then
      self.timed_out = true
      core.kill(self.pid, core.SIGKILL)
      while not self.done do sched.sleep(0.01) end
    end
    return {status = self.status, signal = self.signal, out = table.concat(self.out),
            err = table.concat(self.err), elapsed = self.elapsed, timed_out = self.timed_out or false}
  end
  function h:kill(sig) core.kill(self.pid, sig or core.SIGTERM) end
  return h
end

-- Runs rpchost with args and waits (bounded). Returns the result table.
function S.run(args, opts)
  return S.start(args, opts):wait(opts and opts.timeout or 60)
end

-- Runs `script_text` as a world of n ranks under the launcher.
function S.world(n, script_text, opts)
  opts = opts or {}
  local path = S.write(script_text)
  local args = {"run", "--nproc-per-node", tostring(n)}
  for _, a in ipairs(opts.launcher_args or {}) do args[#args + 1] = a end
  args[#args + 1] = path
  for _, a in ipairs(opts.args or {}) do args[#args + 1] = a end
  return S.run(args, opts)
end

-- Runs S.prelude .. body as a world of n ranks started by hand (each its own
-- process with RANK and WORLD_SIZE, rank 0 hosting the store), not under the
-- launcher, which stops the world when a rank fails: results by rank.
function S.by_hand(n, body, extra_env, timeout)
  local port = S.free_port()
  local path = S.write(S.prelude .. body)
  local hs = {}
  for rk = 0, n - 1 do
    local env = {RANK = rk, WORLD_SIZE = n, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port}
    for k, v in pairs(extra_env or {}) do env[k] = v end
    hs[rk] = S.start({path}, {env = env})
  end
  local out = {}
  for rk = 0, n - 1 do out[rk] = hs[rk]:wait(timeout or 40) end
  return out
end

-- A store server on a free loopback port and a client of it.
function S.store()
  local store = require "rpchost.store"
  local server = store.serve("127.0.0.1", 0)
  return server, store.connect("127.0.0.1", server.port, 5)
end

-- Lines of text as a set-like table: has[line] = true
function S.lines(text)
  local t = {}
  for line in text:gmatch("[^\n]+") do t[#t + 1] = line; t[line] = true end
  return t
end

-- A world of n ranks running S.prelude .. body: the result and its stdout lines.
function S.checked_world(n, body, opts)
  local r = S.world(n, S.prelude .. body, opts)
  return r, S.lines(r.out)
end

-- Every named check printed "ok <name>", and none printed FAIL.
local assert = require "luassert" -- (busted's assert lives in the specs' environment)
function S.assert_oks(r, lines, names)
  for _, name in ipairs(names) do
    assert.is_true(lines["ok " .. name] == true, ("missing 'ok %s'\nstdout:\n%s\nstderr:\n%s"):format(
      name, r.out, r.err))
  end
  assert.is_nil(r.out:find("FAIL", 1, true), r.out)
end

-- Compares the gradients of sum(f(inputs) * w) with central differences (the
-- inputs float64 tensors; w random, fixed by a seed). Raises naming the element.
function S.gradcheck(name, f, inputs, tol)
  local tensor = require "tensor"
  local f64 = {dtype = tensor.float64}
  tol = tol or 1e-6
  for _, x in ipairs(inputs) do x.requires_grad = true end
  local out = f(unpack(inputs))
  tensor.manual_seed(11)
  local w = tensor.rand(out:size(), f64) + 0.5
  local function scalar() return (f(unpack(inputs)) * w):sum() end
  for _, x in ipairs(inputs) do x.grad = nil end
  scalar():backward()
  local eps = 1e-6
  for k, x in ipairs(inputs) do
    local analytic = x.grad
    assert.truthy(analytic, name .. ": no gradient for input " .. k)
    local flat = x:view(-1)
    for i = 1, x:numel() do
      local orig = flat[i]:item()
      tensor.no_grad(function() flat[i] = orig + eps end)
      local plus = tensor.no_grad(function() return scalar():item() end)
      tensor.no_grad(function() flat[i] = orig - eps end)
      local minus = tensor.no_grad(function() return scalar():item() end)
      tensor.no_grad(function() flat[i] = orig end)
      local numeric = (plus - minus) / (2 * eps)
      local a = analytic:view(-1)[i]:item()
      assert.is_true(math.abs(a - numeric) <= tol * math.max(1, math.abs(numeric)),
        ("%s: input %d element %d: analytic %.10g, numeric %.10g"):format(name, k, i, a, numeric))
    end
  end
end

S.sleep = sched.sleep
S.now = sched.now

-- A prelude for world scripts: rank, world size, and a check helper that
-- prints "ok <name>" or "FAIL <name>: <why>".
S.prelude = [==[
local rpc = require "rpc"
local dist = require "dist"
local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
local function check(name, cond, why)
  print((cond and "ok " or "FAIL ") .. name .. (cond and "" or (": " .. tostring(why))))
end
local function raises(fn, ...)
  local ok, e = pcall(fn, ...)
  return not ok, e
end
]==]

return S
