-- rpchost.trace: Chrome trace events (chrome://tracing, Perfetto) and per-peer
-- counters.
--
-- With RPCHOST_TRACE=path (or rpc.enable_tracing(path)) every outgoing call (from
-- send to reply), every incoming call (queued, then executed), every collective
-- and every store wait becomes a complete event ("ph": "X") on the rank's
-- timeline; the file is written when the process exits. Under `rpchost run` each
-- rank writes path.rankN and the launcher merges them into path.
-- Counters (rpc.stats) are kept always: they cost a few table updates per call.
local core = require "rpchost.core"
local atomic_file = require "rpchost.atomic_file"

local M = {}

local events = nil -- list while tracing
local path = nil
local pid = nil
M.who = nil -- the rank's name, for the process label

local function now_us() return core.now() * 1e6 end
M.now_us = now_us

function M.enabled() return events ~= nil end

-- the events gathered so far, oldest first (nil while tracing is off): for a
-- program that measures itself from its own trace (bench/pipeline.lua reads
-- nn.Pipe's stage events there); read them, do not change them
function M.events() return events end

function M.enable(p)
  path = p
  events = events or {}
end

function M.set_rank(rank, name)
  pid = rank
  M.who = name
end

-- a complete event: name, category, start (us), duration (us), args
function M.complete(name, cat, ts, dur, args)
  if not events then return end
  events[#events + 1] = {name = name, cat = cat, ph = "X", ts = ts, dur = dur, pid = pid or 0,
                         tid = 1, args = args}
end

local function json_string(s)
  return '"' .. tostring(s):gsub('[%c"\\]', function(c)
    return ({['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\t'] = '\\t'})[c] or ("\\u%04x"):format(c:byte())
  end) .. '"'
end

local function json(v)
  local t = type(v)
  if t == "number" then return v ~= v and "null" or ("%.17g"):format(v) end
  if t == "boolean" then return tostring(v) end
  if t == "table" then
    local parts = {}
    for k, x in pairs(v) do parts[#parts + 1] = json_string(k) .. ":" .. json(x) end
    return "{" .. table.concat(parts, ",") .. "}"
  end
  if v == nil then return "null" end
  return json_string(v)
end
M.json = json

-- Writes a trace file whole (rpchost.atomic_file: a reader never sees half of
-- one, and a full disk is said, in one line on stderr); returns whether it did.
local function write_trace(into, parts)
  local ok, err = pcall(atomic_file.save, into, function(f)
    f:write('{"traceEvents":[')
    for i, p in ipairs(parts) do f:write(i > 1 and ",\n" or "", p) end
    f:write("]}\n")
  end, {who = "rpchost: trace"})
  if not ok then io.stderr:write(tostring(err), "\n") end
  return ok
end

-- Writes the events gathered so far (called at exit).
function M.flush()
  if not events or not path then return end
  local out = {}
  out[1] = json({name = "process_name", ph = "M", pid = pid or 0, args = {name = M.who or ("rank " .. tostring(pid))}})
  for _, e in ipairs(events) do out[#out + 1] = json(e) end
  write_trace(path, out)
end

-- Merges per-rank trace files into one (used by the launcher).
function M.merge(files, into)
  local parts = {}
  for _, fpath in ipairs(files) do
    local f = io.open(fpath)
    if f then
      local s = f:read("*a")
      f:close()
      local body = s:match('^%s*{"traceEvents":%[(.*)%]}%s*$')
      if body and body ~= "" then parts[#parts + 1] = body end
      os.remove(fpath)
    end
  end
  return write_trace(into, parts)
end

-- counters -----------------------------------------------------------------------
local BUCKETS = {10, 100, 1000, 10000, 100000, 1000000} -- microseconds
local peers = {}

local function peer(name)
  local p = peers[name]
  if not p then
    p = {calls_out = 0, calls_in = 0, errors = 0, bytes_out = 0, bytes_in = 0, latency_us = {}}
    for i = 1, #BUCKETS + 1 do p.latency_us[i] = 0 end
    peers[name] = p
  end
  return p
end

-- the latencies of the last RING calls that completed, for percentiles over a
-- recent window (rpchost.tools.introspect; `rpchost top`): M.done_seq counts them all
local RING = 4096
local ring = {}
M.done_seq = 0
function M.recent_latencies(after_seq)
  local first = math.max(after_seq or 0, M.done_seq - RING) + 1
  local out = {}
  for s = first, M.done_seq do out[#out + 1] = ring[(s - 1) % RING + 1] end
  return out
end

function M.call_done(name, dur_us, failed)
  local seq = M.done_seq + 1
  M.done_seq = seq
  ring[(seq - 1) % RING + 1] = dur_us
  local p = peers[name] or peer(name)
  p.calls_out = p.calls_out + 1
  if failed then p.errors = p.errors + 1 end
  local i = 1
  while i <= #BUCKETS and dur_us >= BUCKETS[i] do i = i + 1 end
  p.latency_us[i] = p.latency_us[i] + 1
end

-- A member that left for good: its counters go (a world visited all day by
-- tools must not keep one set per visitor). The totals stay in M.done_seq.
function M.forget_peer(name) peers[name] = nil end
function M.peer_count()
  local n = 0
  for _ in pairs(peers) do n = n + 1 end
  return n
end

function M.call_in(name) local p = peers[name] or peer(name) p.calls_in = p.calls_in + 1 end

-- bytes of one frame (body and payload) received from / sent to a peer (a
-- number: a received body is lent, and its length is the connection's to tell)
function M.bytes_in(name, n)
  local p = peers[name] or peer(name) -- (a known peer: no call)
  p.bytes_in = p.bytes_in + n
end
function M.bytes_out(name, n)
  local p = peers[name] or peer(name)
  p.bytes_out = p.bytes_out + n
end

-- {peers = {name = {calls_out, calls_in, errors, latency_us = {"<10" = n, ...}}}, bytes_in, bytes_out}
function M.stats()
  local out = {peers = {}}
  for name, p in pairs(peers) do
    local h = {}
    for i, n in ipairs(p.latency_us) do
      local label = i <= #BUCKETS and ("<" .. BUCKETS[i]) or (">=" .. BUCKETS[#BUCKETS])
      h[label] = n
    end
    out.peers[name] = {calls_out = p.calls_out, calls_in = p.calls_in, errors = p.errors,
                       bytes_out = p.bytes_out, bytes_in = p.bytes_in, latency_us = h}
  end
  local net = core.net_stats()
  out.bytes_in, out.bytes_out = net.bytes_in, net.bytes_out
  return out
end

if os.getenv("RPCHOST_TRACE") and os.getenv("RPCHOST_TRACE") ~= "" then M.enable(os.getenv("RPCHOST_TRACE")) end

return M
