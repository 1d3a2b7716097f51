-- rpchost.tools.testing: worlds for a user's own tests (docs/testing.md), what
-- PyTorch's MultiProcessTestCase is to its users.
--
-- A test running inside rpchost (`busted --lua=rpchost`) starts a world of N
-- ranks from a script (its text, or a file), each rank its own rpchost process
-- with torchrun's variables, and waits for it, bounded: it gets each rank's exit
-- status and its stdout and stderr apart. The world's store is hosted here, in
-- the test's process, on a port the kernel picks (so worlds of tests running at
-- once cannot collide, and the store outlives a rank 0 that dies); every rank
-- listens on a free port of its own. As under `rpchost run`, the first rank to
-- fail stops the others (SIGTERM, then SIGKILL after `grace` seconds), unless
-- told not to; past the timeout every rank still running is killed. Nothing is
-- left behind: the script file, the store and the processes all go.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local store = require "rpchost.store"

local M = {}

-- The variables of a world a test's own environment may hold (it may itself run
-- as a rank): each rank gets its own instead.
local WORLD_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "RPCHOST_STORE_HOSTED", "RPCHOST_ERROR_FILE", "RPCHOST_LAUNCHER_PID",
                    "RPCHOST_RESTART_COUNT", "RPCHOST_TRACE"}

local function env_list(base, extra)
  local e = {}
  for k, v in pairs(base) do e[k] = v end
  for k, v in pairs(extra) do e[k] = v ~= false and tostring(v) or nil end -- (false: unset it)
  local l = {}
  for k, v in pairs(e) do l[#l + 1] = k .. "=" .. v end
  return l
end

-- The script to run: text, or {file = path}; returns the path and the folder
-- made for it (nil when the file is the caller's).
local function script_path(script)
  if type(script) == "table" and type(script.file) == "string" then return script.file, nil end
  if type(script) ~= "string" then
    error("rpchost.tools.testing: the script is its text (a string) or {file = path}, got " .. type(script), 3)
  end
  local dir = assert(core.mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/rpchost-test-XXXXXX"))
  local path = dir .. "/world.lua"
  local f = assert(io.open(path, "w"))
  f:write(script)
  f:close()
  return path, dir
end

local World = {}
World.__index = World
M.World = World -- (its methods, for docs/testing.md's check)

-- How rank r ended, in words.
local function ending(r)
  if r.status == nil then return "running" end
  if r.signal ~= 0 then return ("killed by signal %d%s"):format(r.signal, r.stopped and " (stopped by the test)" or "") end
  return ("exit code %d"):format(r.status)
end

-- A readable account of the world: how each rank ended, and its output. For
-- an assertion's message: assert(w.ok, w:report()).
function World:report()
  local out = {("world of %d rank%s: %s after %.1f s"):format(self.size, self.size == 1 and "" or "s",
    self.ok and "all exited 0" or self.timed_out and ("timed out (%g s)"):format(self.timeout) or
    self.failed and ("rank %d failed first"):format(self.failed) or "running", self.elapsed or
    (sched.now() - self.started))}
  for r = 0, self.size - 1 do
    local x = self.ranks[r]
    out[#out + 1] = ("--- rank %d: %s"):format(r, ending(x))
    if x.out ~= "" then out[#out + 1] = "stdout:\n" .. x.out:gsub("\n$", "") end
    if x.err ~= "" then out[#out + 1] = "stderr:\n" .. x.err:gsub("\n$", "") end
  end
  return table.concat(out, "\n")
end

-- Sends sig to rank r (or, without r, to every rank still running).
function World:kill(r, sig)
  for rank = r or 0, r or self.size - 1 do
    local x = self.ranks[rank]
    if x and x.pid and x.status == nil then core.kill(x.pid, sig or core.SIGTERM) end
  end
end

-- Stops every rank still running: SIGTERM, then SIGKILL after `grace` seconds.
function World:stop()
  if self.stopping then return end
  self.stopping = true
  for r = 0, self.size - 1 do
    local x = self.ranks[r]
    if x.status == nil then x.stopped = true end
  end
  self:kill(nil, core.SIGTERM)
  sched.after(self.grace, function() self:kill(nil, core.SIGKILL) end)
end

-- Waits until every rank has exited, or the world's timeout (from its start)
-- has passed: then every rank still running is killed. Returns the world,
-- whose fields are set: ok (every rank exited 0 in time), timed_out, elapsed,
-- failed (the first rank that did not exit 0), ranks[r] = {rank, pid, status,
-- signal, out, err, stopped}.
function World:wait()
  local deadline = self.started + self.timeout
  while self.live > 0 do
    local left = deadline - sched.now()
    if left <= 0 then break end
    self.waiter = sched.current()
    sched.suspend_until("a world of " .. self.size .. " ranks to exit", left)
    self.waiter = nil
  end
  if self.live > 0 then
    self.timed_out = true
    self:kill(nil, core.SIGKILL)
    -- (SIGKILL cannot be refused: each exit is heard within moments)
    local until_ = sched.now() + 10
    while self.live > 0 and sched.now() < until_ do
      self.waiter = sched.current()
      sched.suspend_until("killed ranks to exit", until_ - sched.now())
      self.waiter = nil
    end
  end
  self:close()
  self.ok = not self.timed_out and self.failed == nil
  return self
end

-- Ends what the world holds here: its store and its script (also on a wait
-- that never came: call it, or wait, once).
function World:close()
  if self.closed then return end
  self.closed = true
  self.elapsed = self.elapsed or (sched.now() - self.started)
  if self.server then self.server:close(); self.server = nil end
  if self.dir then
    os.remove(self.path)
    core.rmdir(self.dir)
  end
end

local function on_exit(w, x, status, signal)
  x.status, x.signal = status, signal
  x.out, x.err = table.concat(x.chunks[1]), table.concat(x.chunks[2])
  x.chunks = nil
  w.live = w.live - 1
  if (status ~= 0 or signal ~= 0) and w.failed == nil and not w.stopping then
    w.failed = x.rank
    if w.stop_on_failure then w:stop() end
  end
  if w.live == 0 then w.elapsed = sched.now() - w.started end
  if w.waiter then sched.wake(w.waiter) end
end

-- start(n, script, opts) -> a World whose ranks are running (wait() for them).
-- script: the text of the script every rank runs, or {file = path}.
-- opts: timeout (seconds for the whole world, default 60), env (variables for
-- every rank, or a function(rank) -> table of them; false unsets one), args
-- (the script's arguments), cwd, grace (seconds between SIGTERM and SIGKILL,
-- default 3), stop_on_failure (default true), bin (the rpchost to run, default
-- this one).
function M.start(n, script, opts)
  opts = opts or {}
  if type(n) ~= "number" or n < 1 or n ~= math.floor(n) then
    error("rpchost.tools.testing: the world's size must be an integer >= 1, got " .. tostring(n), 2)
  end
  if not sched.current() then error("rpchost.tools.testing: start a world from a task (a spec run by rpchost)", 2) end
  local path, dir = script_path(script)
  local server = store.serve("127.0.0.1", 0)
  local w = setmetatable({size = n, ranks = {}, live = 0, started = sched.now(), timeout = opts.timeout or 60,
    grace = opts.grace or 3, stop_on_failure = opts.stop_on_failure ~= false, path = path, dir = dir,
    server = server, port = server.port}, World)
  local base = core.environ()
  for _, k in ipairs(WORLD_VARS) do base[k] = nil end
  local bin = opts.bin or core.exepath()
  local args = {bin, path}
  for _, a in ipairs(opts.args or {}) do args[#args + 1] = tostring(a) end
  for r = 0, n - 1 do
    local vars = {RANK = r, WORLD_SIZE = n, LOCAL_RANK = r, LOCAL_WORLD_SIZE = n, MASTER_ADDR = "127.0.0.1",
                  MASTER_PORT = server.port, RPCHOST_STORE_HOSTED = "127.0.0.1:" .. server.port}
    local extra = type(opts.env) == "function" and opts.env(r) or opts.env or {}
    for k, v in pairs(extra) do vars[k] = v end
    local x = {rank = r, chunks = {{}, {}}, out = "", err = ""}
    w.ranks[r] = x
    local p, err = core.spawn{
      file = bin, args = args, env = env_list(base, vars), cwd = opts.cwd,
      stdio = {"inherit", "pipe", "pipe"},
      output = function(fd, chunk) if chunk and x.chunks then table.insert(x.chunks[fd], chunk) end end,
      exit = function(status, signal) on_exit(w, x, status, signal) end,
    }
    if not p then
      w:stop()
      w:close()
      error(("rpchost.tools.testing: cannot start rank %d (%s): %s"):format(r, bin, tostring(err)), 2)
    end
    x.pid = p:pid()
    w.live = w.live + 1
  end
  return w
end

-- world(n, script, opts): start(n, script, opts):wait(), the usual way.
function M.world(n, script, opts)
  return M.start(n, script, opts):wait()
end

return M
