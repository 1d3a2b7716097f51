-- rpchost.tools.top: `rpchost top`, a live view of a running world in the terminal.
--
--   rpchost top [--master-addr A] [--master-port P] [--token T] [--interval S]
--               [--timeout S] [--name NAME] [--once] [--wait]
--
-- It joins the world as the REPL does (a dynamic member: token-aware, and on
-- loopback the same-user proof), asks every worker for
-- rpchost.introspect.snapshot by name once an interval, and draws one line per
-- worker: calls in/out per second, latency percentiles of its calls since the
-- last refresh, calls pending and the longest one, live RRefs, tensor memory and
-- collectives in progress. Counters become rates here, from the difference of
-- two snapshots, so the workers keep nothing per watcher; below the table, a
-- sparkline per worker of its last refreshes' calls/s and p99, where a stall
-- that builds up shows. `q` or Ctrl-C leave the world cleanly and give the
-- terminal back as it was; `--once` prints one table (after two snapshots, so
-- rates are real) and leaves. When the world stops (its ranks shut down, its
-- store is gone, or none of its ranks can be reached for a while) top says so
-- and leaves; with `--wait` it waits for the next world at the same address.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local report = require "rpchost.tools.report"
local ffi = require "ffi"

local M = {}

local USAGE = [[
usage: rpchost top [--master-addr A] [--master-port P] [--token T] [--interval S]
                   [--timeout S] [--name NAME] [--once] [--wait]

Joins the world whose store is at A:P (default 127.0.0.1 and $MASTER_PORT or
29500) and shows each worker, refreshed every S seconds (default 1):
  IN/s OUT/s   calls received / completed per second (top's own calls left out)
  p50 p90 p99  latency of the calls the worker made since the last refresh
  PEND         its calls waiting for a reply; the longest is shown below the table
  RUN/Q        incoming calls running in handlers / queued for one
  OWN/HELD     RRefs whose value it owns / UserRRefs it holds to others' values
  TENSORS      bytes of live tensor storage (and CUDA memory when in use)
  COLLECTIVE   the collective it is in, and for how long
Below the table, each worker's history over the last refreshes (oldest left):
calls/s (in + out) and p99, as sparklines, so that a stall building up shows.
Keys: q (or Ctrl-C) leaves. --once prints one table and leaves. --timeout: seconds
to wait for the world to be found (default 10, or $RPCHOST_INIT_TIMEOUT).
When the world stops (its ranks shut down, its store is gone, or none of its
ranks answers for GONE_AFTER refreshes) top says so and leaves; --wait: it
waits for the next world at the same address instead, and shows that one.
]]

-- terminal ---------------------------------------------------------------------------------
pcall(ffi.cdef, [[
struct rh_termios { unsigned int c_iflag, c_oflag, c_cflag, c_lflag; unsigned char c_line;
                    unsigned char c_cc[32]; unsigned int c_ispeed, c_ospeed; };
struct rh_pollfd { int fd; short events; short revents; };
int tcgetattr(int fd, struct rh_termios *t);
int tcsetattr(int fd, int when, const struct rh_termios *t);
int poll(struct rh_pollfd *fds, unsigned long n, int timeout);
long read(int fd, void *buf, unsigned long n);
]])
local ICANON, ECHO, VTIME, VMIN, TCSANOW = 2, 8, 5, 6, 0

-- Puts the terminal in cbreak mode (keys arrive one by one, unechoed; Ctrl-C
-- still raises SIGINT); returns the function that restores it.
local function cbreak()
  if not core.isatty(0) then return function() end end
  local saved = ffi.new("struct rh_termios")
  if ffi.C.tcgetattr(0, saved) ~= 0 then return function() end end
  local t = ffi.new("struct rh_termios")
  ffi.copy(t, saved, ffi.sizeof(t))
  t.c_lflag = bit.band(t.c_lflag, bit.bnot(ICANON + ECHO))
  t.c_cc[VMIN], t.c_cc[VTIME] = 1, 0
  ffi.C.tcsetattr(0, TCSANOW, t)
  return function() ffi.C.tcsetattr(0, TCSANOW, saved) end
end

-- the keys typed since the last look (never blocks)
local pfd, kbuf = ffi.new("struct rh_pollfd[1]"), ffi.new("char[64]")
local function keys()
  pfd[0].fd, pfd[0].events, pfd[0].revents = 0, 1, 0
  if ffi.C.poll(pfd, 1, 0) <= 0 then return "" end
  local n = ffi.C.read(0, kbuf, 64)
  if n <= 0 then return nil end -- (stdin closed)
  return ffi.string(kbuf, n)
end

-- formatting ---------------------------------------------------------------------------------
local function bytes(n)
  if not n then return "-" end
  local units, i = {"B", "KiB", "MiB", "GiB", "TiB"}, 1
  while n >= 1024 and i < #units do n, i = n / 1024, i + 1 end
  return (i == 1 and "%d %s" or "%.1f %s"):format(n, units[i])
end

local function us(v)
  if not v then return "-" end
  if v < 1000 then return ("%dus"):format(v) end
  if v < 1e6 then return ("%.1fms"):format(v / 1e3) end
  return ("%.2fs"):format(v / 1e6)
end

local function rate(now, prev, field)
  if not prev or not now.time or now.time <= prev.time then return "-" end
  return ("%.0f"):format((now[field] - prev[field]) / (now.time - prev.time))
end

local COLS = "%-16s %4s %8s %8s %7s %7s %7s %5s %7s %8s %9s  %s"

-- history ----------------------------------------------------------------------------------
-- Each worker's last HISTORY refreshes (by name: a worker keeps its history
-- when the world it is in is followed by another, --wait): calls/s in + out,
-- and the p99 of its calls (false where a refresh had no value).
local HISTORY = 30
M.HISTORY = HISTORY

local function utf8_terminal()
  local loc = os.getenv("LC_ALL") or ""
  if loc == "" then loc = os.getenv("LC_CTYPE") or "" end
  if loc == "" then loc = os.getenv("LANG") or "" end
  return loc:upper():gsub("-", ""):find("UTF8", 1, true) ~= nil
end
-- (eight heights of a block; where the terminal may not draw them, ASCII)
local BARS = utf8_terminal() and {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"} or {"_", ".", "-", "~", "=", "+", "*", "#"}
M.BARS = BARS

-- values (a list with false for a refresh without one) as a sparkline, each
-- scaled to the largest: the last refreshes, oldest first.
function M.sparkline(values)
  local max = 0
  for _, v in ipairs(values) do if v and v > max then max = v end end
  local out = {}
  for i, v in ipairs(values) do
    if not v then out[i] = " "
    elseif max <= 0 then out[i] = BARS[1]
    else out[i] = BARS[math.max(1, math.min(#BARS, math.floor(v / max * (#BARS - 1) + 0.5) + 1))] end
  end
  return table.concat(out)
end

local function push(list, v)
  list[#list + 1] = v
  if #list > HISTORY then table.remove(list, 1) end
end

-- Notes one refresh of worker w into hist (snapshot s and the one before, p).
function M.note_history(hist, w, s, p)
  local h = hist[w.name]
  if not h then h = {rate = {}, p99 = {}}; hist[w.name] = h end
  local r = false
  if s and p and s.time and p.time and s.time > p.time then
    r = ((s.calls_in - p.calls_in) + (s.calls_out - p.calls_out)) / (s.time - p.time)
  end
  push(h.rate, r)
  push(h.p99, s and s.p99_us or false)
end

local function last_value(list)
  for i = #list, 1, -1 do if list[i] then return list[i] end end
  return nil
end

local function max_value(list)
  local m = nil
  for _, v in ipairs(list) do if v and (not m or v > m) then m = v end end
  return m
end

-- A sparkline in brackets, padded to HISTORY refreshes.
local function boxed(list)
  return "[" .. M.sparkline(list) .. (" "):rep(HISTORY - #list) .. "]"
end

local function history_lines(workers, hist)
  local lines = {"", ("HISTORY (last %d refreshes, oldest left)"):format(HISTORY),
                 ("%-16s %-" .. (HISTORY + 2) .. "s %-14s %-" .. (HISTORY + 2) .. "s %s"):format("WORKER",
                   "CALLS/s (in+out)", "now / max", "p99", "now / max")}
  for _, w in ipairs(workers) do
    local h = hist[w.name]
    if h then
      local rnow, rmax = last_value(h.rate), max_value(h.rate)
      lines[#lines + 1] = ("%-16s %s %-14s %s %s"):format(w.name, boxed(h.rate),
        ("%s / %s"):format(rnow and ("%.0f"):format(rnow) or "-", rmax and ("%.0f"):format(rmax) or "-"),
        boxed(h.p99), ("%s / %s"):format(us(last_value(h.p99)), us(max_value(h.p99))))
    end
  end
  return lines
end

-- The screen for one refresh: a list of lines (hist: the workers' histories,
-- drawn below the table when given).
function M.render(where, workers, snaps, prevs, errs, hist)
  local lines = {
    ("rpchost top - the world at %s - %d worker%s - %s   (q quits)"):format(where, #workers,
      #workers == 1 and "" or "s", os.date("%H:%M:%S")),
    "",
    COLS:format("WORKER", "RANK", "IN/s", "OUT/s", "p50", "p90", "p99", "PEND", "RUN/Q", "OWN/HELD",
      "TENSORS", "COLLECTIVE"),
  }
  local notes = {}
  for _, w in ipairs(workers) do
    local s, p = snaps[w.id], prevs[w.id]
    if s then
      local coll = s.collectives and s.collectives[1]
      local mem = bytes(s.tensor_bytes) .. (s.cuda_bytes and (" +" .. bytes(s.cuda_bytes) .. " cuda") or "")
      lines[#lines + 1] = COLS:format(w.name, w.id, rate(s, p, "calls_in"), rate(s, p, "calls_out"),
        us(s.p50_us), us(s.p90_us), us(s.p99_us), s.pending, ("%d/%d"):format(s.handling or 0, s.queued or 0),
        ("%d/%d"):format(s.rrefs_owned or 0, s.rrefs_held or 0), mem,
        coll and ("%s %.1fs%s"):format(coll.what, coll.running,
          #s.collectives > 1 and (" (+%d)"):format(#s.collectives - 1) or "") or "-")
      if s.oldest then
        notes[#notes + 1] = ("  %s: longest pending call: %s on %s, waiting %.1f s"):format(
          w.name, s.oldest.fn, s.oldest.to, s.oldest.waited)
      end
    else
      lines[#lines + 1] = ("%-16s %4s  %s"):format(w.name, w.id, errs[w.id] or "no answer yet")
    end
  end
  if #notes > 0 then
    lines[#lines + 1] = ""
    for _, n in ipairs(notes) do lines[#lines + 1] = n end
  end
  if hist then
    for _, l in ipairs(history_lines(workers, hist)) do lines[#lines + 1] = l end
  end
  return lines
end

-- the world ------------------------------------------------------------------------------------
local function parse(argv)
  local o, i = {interval = 1}, 1
  local takes = {["--master-addr"] = "addr", ["--master-port"] = "port", ["--name"] = "name",
                 ["--token"] = "token", ["--interval"] = "interval", ["--timeout"] = "timeout"}
  while argv[i] do
    local a = argv[i]
    if takes[a] then
      local v = argv[i + 1]
      if v == nil or v:sub(1, 2) == "--" then return nil, a .. " needs a value" end
      if (a == "--master-port" or a == "--interval" or a == "--timeout") and not tonumber(v) then
        return nil, ("%s must be a number, got '%s'"):format(a, v)
      end
      o[takes[a]] = v
      i = i + 2
    elseif a == "--once" then o.once = true; i = i + 1
    elseif a == "--wait" then o.wait = true; i = i + 1
    elseif a == "-h" or a == "--help" then return nil, "help"
    else return nil, "unknown option " .. a end
  end
  o.interval = tonumber(o.interval)
  if o.interval <= 0 then return nil, "--interval must be more than 0 seconds" end
  if o.once and o.wait then return nil, "--once and --wait do not go together (--once leaves after one table)" end
  return o
end

-- A refresh's snapshots: every worker but top itself asked at once, then
-- their answers (snaps, prevs, errs and kinds by id: the error and its kind).
local function refresh(rpc, snapshot, me, o, st)
  local workers = {}
  for _, w in ipairs(rpc.workers()) do
    if w.name ~= me then workers[#workers + 1] = w end
  end
  table.sort(workers, function(x, y) return x.id < y.id end)
  local futs = {}
  for _, w in ipairs(workers) do
    local prev = st.snaps[w.id]
    local okc, f = pcall(rpc.rpc_async, w.name, snapshot,
      {{watcher = me, after_seq = prev and prev.done_seq}}, nil, math.max(2, 2 * o.interval))
    futs[w.id] = okc and f or nil
    if not okc then st.errs[w.id], st.kinds[w.id] = tostring(f), type(f) == "table" and f.kind end
  end
  for _, w in ipairs(workers) do
    local f = futs[w.id]
    if f then
      local okw, s = pcall(f.wait, f)
      st.prevs[w.id] = st.snaps[w.id]
      if okw then st.snaps[w.id], st.errs[w.id], st.kinds[w.id] = s, nil, nil
      else
        st.snaps[w.id], st.errs[w.id] = nil, tostring(type(s) == "table" and s.message or s)
        st.kinds[w.id] = type(s) == "table" and s.kind
      end
    end
    M.note_history(st.hist, w, st.snaps[w.id], st.prevs[w.id])
  end
  return workers
end

-- Refreshes in which none of the world's ranks answered (all unreachable)
-- before top calls the world gone although its store still answers (a launcher
-- keeps it open a while after its ranks were killed).
local GONE_AFTER = 3
M.GONE_AFTER = GONE_AFTER

-- Why the world has gone, or nil: it says so itself (introspect.world_stopped),
-- or none of its static ranks answered for GONE_AFTER refreshes.
local function world_gone(a, workers, st)
  local why = require("rpchost.tools.introspect").world_stopped(a)
  if why then return why end
  local static, lost = 0, 0
  for _, w in ipairs(workers) do
    if w.id < a.world_size then
      static = static + 1
      if st.kinds[w.id] == "unreachable" then lost = lost + 1 end
    end
  end
  if static > 0 and lost == static then st.unreachable = st.unreachable + 1 else st.unreachable = 0 end
  if st.unreachable >= GONE_AFTER then
    return ("none of its %d ranks could be reached in %d refreshes"):format(static, GONE_AFTER)
  end
  return nil
end

-- Waits for the next refresh, looking at the keyboard ten times a second;
-- returns true when the user asked to quit.
local function pause(o, quit, seconds)
  local t_end = core.now() + seconds
  while not quit() and core.now() < t_end do
    if not o.once and core.isatty(0) then
      local k = keys()
      if k == nil or k:find("[qQ\3]") then return true end
    end
    if not quit() then sched.sleep(math.min(0.1, seconds)) end
  end
  return quit()
end

local function draw(tty, lines)
  io.stdout:write(tty and "\27[H\27[2J" or "\n", table.concat(lines, "\n"), "\n")
  io.stdout:flush()
end

-- Joins the world at `where` as me; with o.wait, tries again until one is
-- there (or the user quits: then false). Raises when it cannot join, as
-- init_rpc says why.
local function join(rpc, o, where, me, tty, quit, waiting_for)
  -- (a watcher pointed at no world says so soon, not after a training job's 300 s)
  local wait = tonumber(o.timeout) or tonumber(os.getenv("RPCHOST_INIT_TIMEOUT")) or 10
  while true do
    local ok, err = pcall(rpc.init_rpc, me, {rpc_backend_options = rpc.TensorPipeRpcBackendOptions{
      init_method = "tcp://" .. where, init_timeout = o.wait and math.min(wait, 2) or wait}})
    if ok then return true end
    if not o.wait then error(err, 0) end
    draw(tty, {("rpchost top - %s - %s"):format(where, os.date("%H:%M:%S")), "",
      waiting_for or ("waiting for a world at %s (--wait; q quits)"):format(where)})
    if pause(o, quit, o.interval) then return false end
  end
end

function M.main(argv)
  local o, why = parse(argv)
  if not o then
    if why == "help" then io.stdout:write(USAGE) return 0 end
    io.stderr:write("rpchost top: ", why, " (rpchost top --help)\n")
    return 2
  end
  if o.token then core.setenv("RPCHOST_TOKEN", o.token) end
  for _, k in ipairs({"RANK", "WORLD_SIZE", "LOCAL_RANK"}) do core.setenv(k, nil) end
  require("rpchost.env").detach() -- (a member by address, even under srun or in a batch script)
  local tty = core.isatty(1)
  local restore = function() end
  local screen = false
  local function leave_screen()
    if screen then io.stdout:write("\27[?25h\27[?1049l") screen = false end
  end
  local gone_text
  local ok, err = sched.run(function()
    local rpc = require "rpc"
    -- (a module function: it travels by name, and the worker requires the module)
    local snapshot = require("rpchost.tools.introspect").snapshot
    local where = ("%s:%s"):format(o.addr or "127.0.0.1", o.port or os.getenv("MASTER_PORT") or "29500")
    local me = o.name or ("top-" .. core.getpid())
    local quitting = false
    local function quit() return quitting end
    local sigs = {}
    for _, name in ipairs({"SIGINT", "SIGTERM"}) do
      sigs[#sigs + 1] = core.signal(core[name], function() quitting = true end)
    end
    if not o.once then
      restore = cbreak()
      if tty then io.stdout:write("\27[?1049h\27[?25l") screen = true end -- the alternate screen, no cursor
    end
    local hist = {}
    local waiting_for = nil
    while not quitting do
      if not join(rpc, o, where, me, tty, quit, waiting_for) then break end
      local a = rpc._agent()
      local st = {snaps = {}, prevs = {}, errs = {}, kinds = {}, hist = hist, unreachable = 0}
      local rounds = 0
      local gone = nil
      while not quitting do
        local workers = refresh(rpc, snapshot, me, o, st)
        rounds = rounds + 1
        gone = world_gone(a, workers, st)
        if gone then break end
        if o.once then
          if rounds >= 2 then
            io.stdout:write(table.concat(M.render(where, workers, st.snaps, st.prevs, st.errs), "\n"), "\n")
            quitting = true
            break
          end
        else
          draw(tty, M.render(where, workers, st.snaps, st.prevs, st.errs, hist))
        end
        if pause(o, quit, o.interval) then quitting = true end
      end
      pcall(rpc.shutdown, not gone)
      if gone then
        gone_text = ("the world at %s has stopped: %s"):format(where, gone)
        if not o.wait then break end
        waiting_for = gone_text .. ("; waiting for the next world there (--wait; q quits)")
      end
    end
    restore()
    leave_screen()
    for _, s in ipairs(sigs) do s:close() end
    pcall(rpc.shutdown)
  end, "top")
  restore()
  leave_screen()
  if not ok then
    -- (an error object says what to do; a traceback is for bugs)
    io.stderr:write("rpchost top: ", require("rpchost.errors").is(err) and tostring(err) or report.format_error(err), "\n")
    return 1
  end
  -- (said after the screen is given back, where it stays)
  if gone_text and not o.wait then io.stdout:write("rpchost top: ", gone_text, "\n") end
  return 0
end

return M
