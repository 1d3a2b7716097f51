-- rpchost.compat: the Lua 5.2 conveniences API.md relies on (table.pack keeps
-- nils in argument lists), added to LuaJIT's 5.1 standard library.
table.pack = table.pack or function(...) return {n = select("#", ...), ...} end
table.unpack = table.unpack or unpack
-- os.exit first lets a store this process hosts serve its other clients until
-- they leave (bounded: RPCHOST_STORE_LINGER, 30 s) and queued frames leave
-- (bounded: 2 s), then closes the Lua state (as os.exit(code, true) does) so
-- tensors and other userdata are finalised even when a script exits early.
-- Before all that it runs the functions given to before_exit: what would
-- otherwise be lost with the process (a SummaryWriter's buffered records; the
-- finalisers cannot do it: what they would write may be finalised first).
local M = {}
local before_exit = {}
function M.before_exit(fn) before_exit[#before_exit + 1] = fn end
local raw_exit = os.exit
os.exit = function(code)
  -- (a task that the scheduler started inside its poll of the rings waits
  -- until the poll returns, and exits then: rpchost.sched.defer_exit; where
  -- the loop still may not run, in a callback of that poll that cannot wait,
  -- the exit skips the loop's last turns)
  local sched = package.loaded["rpchost.sched"]
  if sched then sched.defer_exit() end
  local loop_may_run = not sched or sched.loop_may_run()
  for _, fn in ipairs(before_exit) do
    local ok, err = pcall(fn)
    if not ok then io.stderr:write("rpchost: ", tostring(err), "\n") end
  end
  local ok, core = pcall(require, "rpchost.core")
  local tok, trace = pcall(require, "rpchost.trace")
  if tok then trace.flush() end
  if ok and loop_may_run then
    local sok, store = pcall(require, "rpchost.store")
    if sok then
      pcall(store.exit_linger, tonumber(os.getenv("RPCHOST_STORE_LINGER")) or 30, function()
        core.flush()
        core.run("nowait")
        core.sleep_ms(1)
      end)
    end
    core.flush()
    local deadline = core.now() + 2
    while core.net_busy() > 0 and core.now() < deadline do
      core.run("nowait")
      core.sleep_ms(1)
    end
  elseif ok then
    core.flush()
  end
  return raw_exit(code, true)
end
return M
