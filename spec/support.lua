-- spec/support.lua: helpers for specs that start real rpchost processes.
-- Specs run inside rpchost (busted --lua=rpchost), so these helpers block the
-- spec's task while the loop runs child processes; every wait is bounded, and
-- every wait for something to happen is S.wait_until. A world script names
-- each of its checks once, in check("<name>", ...): S.assert_checks reads the
-- names from the script. Processes are ended by their own pid, never by name.
-- (The tiers a spec's describe blocks are tagged with: README, "Quick start".)
local core = require "rpchost.core"
local sched = require "rpchost.sched"

local S = {}

S.bin = os.getenv("RPCHOST_BIN") or core.exepath()
S.root = os.getenv("RPCHOST_SOURCE_DIR") or "."

-- The spec's scratch directory; a process the spec started that loads this
-- file (a world script requiring spec.wire) shares it instead of making its own
-- (and names what it writes there after its pid).
local tmp_counter = 0
local shared = os.getenv("RPCHOST_SPEC_TMPDIR")
local tmpdir = shared or (os.getenv("TMPDIR") or "/tmp") .. ("/rpchost-spec-%d"):format(core.getpid())
if not shared then
  os.execute("mkdir -p " .. tmpdir)
  -- (gone with the process that made it, whether busted returns, after a
  -- run that passed, or exits: a whole run of the suite left ~180 of them in
  -- /tmp; the worlds it started have ended by then)
  local function remove() os.execute("rm -rf '" .. tmpdir:gsub("'", "'\\''") .. "'") end
  sched.at_exit(remove, true)
  require("rpchost.compat").before_exit(remove)
end
S.tmpdir = tmpdir
local script_name = shared and ("script-" .. core.getpid() .. "-%d.lua") or "script%d.lua"

-- Writes `text` to a fresh file and returns its path (the text is remembered:
-- a process started on the file has it as its result's .script).
local written = {}
function S.write(text, name)
  tmp_counter = tmp_counter + 1
  local path = ("%s/%s"):format(tmpdir, name or script_name:format(tmp_counter))
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  written[path] = text
  return path
end

-- The one way a spec waits for something to happen: wait_until(cond, timeout,
-- what[, every]) calls cond every `every` s (default 0.01) while the loop runs,
-- and returns its first true value; past `timeout` s it raises an error naming
-- `what` (a string, or a function called then, for the state worth showing).
-- World scripts have it too: it is in S.prelude, from this same text.
local WAIT_UNTIL = [==[
local function wait_until(cond, timeout, what, every)
  local sched = require "rpchost.sched"
  local deadline = sched.now() + timeout
  while true do
    local v = cond()
    if v then return v end
    local left = deadline - sched.now()
    if left <= 0 then
      if type(what) == "function" then what = what() end
      error(("waited %g s in vain for %s"):format(timeout, tostring(what)), 2)
    end
    sched.sleep(math.min(every or 0.01, left))
  end
end
]==]
S.wait_until = assert(loadstring(WAIT_UNTIL .. "return wait_until", "=spec/support.lua:wait_until"))()

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
  e.RPCHOST_SPEC_TMPDIR = tmpdir
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
  for _, a in ipairs(args) do h.script = h.script or written[a] end -- (for S.assert_checks)
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
      S.wait_until(function() return self.done end, 10, "process " .. self.pid .. " to end after SIGKILL")
    end
    return {status = self.status, signal = self.signal, out = table.concat(self.out),
            err = table.concat(self.err), elapsed = self.elapsed, timed_out = self.timed_out or false,
            script = self.script}
  end
  function h:kill(sig) core.kill(self.pid, sig or core.SIGTERM) end
  return h
end

-- Kills (SIGKILL) a process the spec started through a shell (a backgrounded
-- child, a tmux pane), by the pid written down when it started, and only while
-- its command line still holds `cmd` (by then the pid could be another's):
-- never by name. Returns whether it killed it.
function S.kill_pid(pid, cmd)
  local f = io.open("/proc/" .. tostring(pid) .. "/cmdline")
  local line = f and f:read("*a"):gsub("%z", " ") or ""
  if f then f:close() end
  if not line:find(cmd, 1, true) then return false end
  core.kill(tonumber(pid), core.SIGKILL)
  return true
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

local assert = require "luassert" -- (busted's assert lives in the specs' environment)

-- The string literal that starts at text[i] ("...", '...' or [=[...]=]): its
-- value and the position after it; nil where none starts there.
local function literal_at(text, i)
  local q = text:sub(i, i)
  local j
  if q == '"' or q == "'" then
    j = i + 1
    while j <= #text do
      local c = text:sub(j, j)
      if c == "\\" then j = j + 1 elseif c == q then break elseif c == "\n" then return nil end
      j = j + 1
    end
  else
    local eq = text:match("^%[(=*)%[", i)
    if not eq then return nil end
    local _, e = text:find("]" .. eq .. "]", i, true)
    j = e
  end
  if not j or j > #text then return nil end
  local f = loadstring("return " .. text:sub(i, j))
  return f and f(), j + 1
end

-- The checks a world script makes, as its text names them: the literal first
-- argument of every check("<name>", ...) call (names), and the literal start
-- of every name built at run time, check("<start>" .. x, ...) (starts). A call
-- whose first argument starts with no literal names nothing here.
function S.check_names(text)
  local names, starts, seen = {}, {}, {}
  local pos = 1
  while true do
    local s, e = text:find("check%s*%(%s*", pos)
    if not s then break end
    pos = e + 1
    if not text:sub(s - 1, s - 1):match("[%w_.:]") then
      local name, after = literal_at(text, e + 1)
      if type(name) == "string" then
        local list = text:find("^%s*%.%.", after) and starts or names
        if not seen[list] then seen[list] = {} end
        if not seen[list][name] then seen[list][name] = true; list[#list + 1] = name end
      end
    end
  end
  return names, starts
end

-- The names of the checks that printed "ok <name>" in stdout text (a line may
-- carry the launcher's --prefix): a list, and a set by name.
local function oks_in(out)
  local oks = {}
  for line in out:gmatch("[^\n]+") do
    local name = line:gsub("^%[rank%d+%]: ", ""):match("^ok (.*)$")
    if name then oks[#oks + 1] = name; oks[name] = true end
  end
  return oks
end

-- Each world check is named once, in its script: every check the script's
-- text names (S.check_names) printed "ok <name>", and no check printed FAIL.
-- r: what S.world, S.run or a handle's wait returned, whose .script is the
-- script it ran (any file S.write made), or results by rank (S.by_hand's, or a
-- spec's own table of them), where opts.on is the rank (or list of ranks)
-- whose stdout must hold every ok, or "any" where each check is made in a
-- branch of one rank only (each ok must then be in some rank's stdout); no
-- rank may print FAIL. opts.times: how many times each check named in full
-- must print ok in each of those outputs (a check every rank of a launcher's
-- world makes: the world's size); without it, at least once. opts.script: the
-- script's text, where the results do not carry it.
function S.assert_checks(r, opts)
  opts = opts or {}
  local by_rank = r.out == nil
  local results = by_rank and r or {r}
  local script = opts.script
  for _, res in pairs(results) do script = script or res.script end
  assert(script, "S.assert_checks: no script text (pass opts.script)")
  local names, starts = S.check_names(script)
  assert(#names + #starts > 0, "S.assert_checks: the script names no check")
  local all = {}
  for k, res in pairs(results) do
    local where = by_rank and (" on rank " .. tostring(k)) or ""
    all[#all + 1] = ("stdout%s:\n%s\nstderr%s:\n%s"):format(where, res.out, where, res.err)
    assert.is_nil(res.out:find("FAIL", 1, true), ("a check failed%s:\n%s\nstderr:\n%s"):format(where, res.out,
      res.err))
  end
  all = table.concat(all, "\n")
  -- the outputs that must hold every ok: the world's; each rank's that opts.on
  -- names; or, with on = "any", all ranks' together
  local outputs = {}
  if not by_rank then
    outputs[1] = {out = r.out, where = ""}
  elseif opts.on == "any" then
    local t = {}
    for _, res in pairs(results) do t[#t + 1] = res.out end
    outputs[1] = {out = table.concat(t, "\n"), where = " on any rank"}
  else
    assert(opts.on ~= nil, "S.assert_checks: results by rank need opts.on, the rank(s) whose output holds the checks")
    for _, k in ipairs(type(opts.on) == "table" and opts.on or {opts.on}) do
      assert(results[k], "S.assert_checks: no result for rank " .. tostring(k))
      outputs[#outputs + 1] = {out = results[k].out, where = " on rank " .. tostring(k)}
    end
  end
  for _, o in ipairs(outputs) do
    local oks = oks_in(o.out)
    for _, name in ipairs(names) do
      assert.is_true(oks[name] == true, ("missing 'ok %s'%s\n%s"):format(name, o.where, all))
      if opts.times then
        local n = 0
        for _, ok in ipairs(oks) do if ok == name then n = n + 1 end end
        assert.are.equal(opts.times, n, ("'ok %s' %d times%s, not %d\n%s"):format(name, n, o.where, opts.times, all))
      end
    end
    for _, start in ipairs(starts) do
      local found = false
      for _, name in ipairs(oks) do found = found or name:sub(1, #start) == start end
      assert.is_true(found, ("no 'ok %s...'%s\n%s"):format(start, o.where, all))
    end
  end
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

-- A prelude for world scripts: rank, world size, a check helper that prints
-- "ok <name>" or "FAIL <name>: <why>" (S.assert_checks reads what they name),
-- and wait_until (as S.wait_until, inside the world script).
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
]==] .. WAIT_UNTIL

return S
