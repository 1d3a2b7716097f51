-- rpchost.tools.introspect: what one worker says about itself when asked over RPC.
--
-- `rpchost top` calls rpchost.introspect.snapshot on every worker (by name, so it
-- needs nothing in the world's scripts) once a refresh. A snapshot holds counters
-- and instantaneous state only: the caller keeps the previous one and turns
-- counters into rates, so a worker keeps no per-watcher state. Everything here
-- reads tables the agent, rref, dist and trace modules already keep; nothing is
-- counted for it beyond trace's ring of recent latencies.
local core = require "rpchost.core"
local trace = require "rpchost.trace"

local M = {}

local function describe_fn(fn)
  if type(fn) == "function" then
    local codec = require "rpchost.wire.codec"
    local p = codec.name_of(fn)
    if p then return codec.path_string(p) end
    local info = debug.getinfo(fn, "S")
    return ("a function at %s:%d"):format(info.short_src, info.linedefined or 0)
  end
  return tostring(fn)
end

local function percentile(sorted, q)
  if #sorted == 0 then return nil end
  return sorted[math.max(1, math.ceil(q * #sorted))]
end

-- snapshot([opts]) -> table (see docs/cli.md, "rpchost top"):
--   opts.after_seq: latencies of calls completed after this count only (the
--     count a previous snapshot returned as done_seq); opts.watcher: a worker
--     name whose own calls are left out of the counters (the watcher's).
function M.snapshot(opts)
  opts = type(opts) == "table" and opts or {}
  local rpc = package.loaded["rpchost.rpc"]
  local a = rpc and rpc._agent and rpc._agent()
  local s = {time = core.now(), pid = core.getpid(), calls_in = 0, calls_out = 0, errors = 0,
             bytes_in = 0, bytes_out = 0}
  if a then s.name, s.rank = a.name, a.rank end
  -- counters (cumulative), without the watcher's own calls
  for name, p in pairs(trace.stats().peers) do
    if name ~= opts.watcher then
      s.calls_in = s.calls_in + p.calls_in
      s.calls_out = s.calls_out + p.calls_out
      s.errors = s.errors + p.errors
      s.bytes_in, s.bytes_out = s.bytes_in + p.bytes_in, s.bytes_out + p.bytes_out
    end
  end
  -- latency of the calls this worker made, over the window since after_seq
  local lat = trace.recent_latencies(tonumber(opts.after_seq) or trace.done_seq)
  table.sort(lat)
  s.done_seq, s.window_calls = trace.done_seq, #lat
  s.p50_us, s.p90_us, s.p99_us = percentile(lat, 0.5), percentile(lat, 0.9), percentile(lat, 0.99)
  -- outgoing calls still waiting, and the longest
  s.pending = 0
  if a then
    local now_us, oldest = trace.now_us(), nil
    for _, call in pairs(a.pending) do
      s.pending = s.pending + 1
      if call.t0 and (not oldest or call.t0 < oldest.t0) then oldest = call end
    end
    if oldest then
      s.oldest = {to = oldest.peer and oldest.peer.name or "?", fn = describe_fn(oldest.fn),
                  waited = (now_us - oldest.t0) / 1e6}
    end
    -- incoming calls running in handlers and queued for one
    s.handling, s.queued = a.running or 0, a.nqueued or 0
  end
  -- RRefs: values this worker owns, and UserRRefs it holds to others' values
  local rs = require("rpchost.rpc.rref").stats()
  s.rrefs_owned, s.rrefs_held = rs.owners, rs.user_forks
  -- tensor memory: host storages; device memory where CUDA is in use
  s.tensor_bytes = core.t_live_bytes()
  local tensor = package.loaded["rpchost.tensor"]
  if tensor and tensor.cuda and tensor.cuda.is_available() then
    local ok, n = pcall(tensor.cuda.memory_allocated)
    if ok then s.cuda_bytes = n end
  end
  -- collectives in progress on this rank
  s.collectives = {}
  local dist = package.loaded["rpchost.dist"]
  if dist and dist._active then
    for e in pairs(dist._active) do
      s.collectives[#s.collectives + 1] = {what = e.what, running = math.max(0, s.time - e.since), async = e.async}
    end
    table.sort(s.collectives, function(x, y) return x.running > y.running end)
  end
  return s
end

-- Why the world a member (the REPL, top) joined has stopped, or nil while it
-- runs: every static rank shut down, or its store is gone. (What the member can
-- tell from where it stands: the world keeps no record of its watchers.)
function M.world_stopped(a)
  if not a or a.state ~= "running" or not a.store then return nil end
  local keys = {}
  for r = 0, a.world_size - 1 do keys[#keys + 1] = a.prefix .. "shutdown/" .. r end
  local ok, got = pcall(a.store.multi_get, a.store, keys)
  if not ok then
    local why = tostring(type(got) == "table" and got.message or got):gsub("^the store at %S+ is gone: ", "")
    return ("its store at %s is gone (%s)"):format(tostring(a.store.addr), why)
  end
  for i = 1, #keys do if not got[i] then return nil end end
  return ("all %d of its ranks shut down"):format(a.world_size)
end

return M
