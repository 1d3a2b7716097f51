-- rpchost.rpc.membership: how a process joins a world, rejoins it after a
-- restart, joins a running one without a rank of its own (rpchost repl), and
-- leaves it together with the others at a graceful shutdown: the protocol over
-- the store (generations, the directory, the shutdown counts) that
-- rpchost.rpc's init_rpc and shutdown drive.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local log = require "rpchost.log"
local store = require "rpchost.store"
local env = require "rpchost.env"
local agentmod = require "rpchost.rpc.agent"
local rref = require "rpchost.rpc.rref"
local device_maps = require "rpchost.rpc.device_maps"
local compat = require "rpchost.compat"
local hosts = require "rpchost.net.hosts"

local M = {}

local function member_answers(client, world, raw)
  -- (proven by the member itself: a port someone else holds now proves nothing)
  return require("rpchost.net.probe").alive(client.cred, world, raw)
end

-- Whether a rank starting in generation gen + 1 should instead take its old
-- place in the world of generation gen: that world is running (another of its
-- ranks has not shut down and answers), and this rank's previous incarnation
-- died there (it registered, never shut down, and no longer answers). One that
-- has not registered may be a second process with the same RANK starting at
-- the same time: the duplicate check decides that. The prefix, or nil.
local function world_to_rejoin(client, key, rank, gen, world_size)
  if gen < 1 then return nil end
  local prev = ("rpc/%d/"):format(gen)
  local mine = client:get(prev .. "worker/" .. rank)
  if not mine or client:get(prev .. "shutdown/" .. rank) then return nil end
  if member_answers(client, key .. "/" .. prev, mine) ~= false then return nil end -- (alive, or cannot tell: the duplicate check says)
  local ws = tonumber(client:get(prev .. "world_size"))
  if ws and ws ~= world_size then return nil end
  for r = 0, (ws or world_size) - 1 do
    if r ~= rank and not client:get(prev .. "shutdown/" .. r) then
      if member_answers(client, key .. "/" .. prev, client:get(prev .. "worker/" .. r)) == true then return prev end
    end
  end
  return nil
end

function M.join(client, key, name, rank, world_size, host, opts, timeout)
  local gen = client:add("rpc/gen/" .. rank, 1)
  local P = ("rpc/%d/"):format(gen)
  -- A rank restarted after it died (same RANK, the others still running) takes
  -- its place in their world, with a new incarnation its peers learn from the
  -- notice it sends them, instead of waiting in a generation nobody else joins.
  local rejoined = gen > 1 and world_to_rejoin(client, key, rank, gen - 1, world_size)
  if rejoined then
    client:add("rpc/gen/" .. rank, -1) -- (in step with the others for the next world)
    gen, P = gen - 1, rejoined
    log.info("rank %d rejoins the running world (%s) in place of its previous incarnation", rank, P)
  end
  -- A second process started with the same RANK lands in the next generation
  -- and would wait there for ranks that already formed the world: if this
  -- rank's previous incarnation is still alive (not shut down, answering at its
  -- address), say so instead.
  local settled = gen == 1 or rejoined -- (once the previous incarnation is found shut down or gone)
  local function check_duplicate()
    if settled then return end
    local prev = ("rpc/%d/"):format(gen - 1)
    local rec = client:get(prev .. "worker/" .. rank)
    if not rec then return end -- (it may not have registered yet)
    if not client:get(prev .. "shutdown/" .. rank) and member_answers(client, key .. "/" .. prev, rec) == true then
      error(errors.new("config", ("init_rpc: rank %d is already running in this world (another process " ..
        "started with RANK=%d is alive); every process needs its own RANK, 0 to %d"):format(rank, rank,
        world_size - 1)), 0)
    end
    settled = true
  end
  check_duplicate()
  local abort = P .. "abort"
  local function fail(msg)
    client:set(abort, msg)
    error(errors.new("config", msg), 0)
  end
  -- world sizes must agree, names must be unique (a rejoining rank holds its
  -- own already): one round trip
  local r = client:batch{{"compare_set", P .. "world_size", "", store.agreement(world_size, rank)},
                         {"compare_set", P .. "name/" .. name, "", tostring(rank)}}
  local same, ows, orank = store.agreed(r[1][1], world_size, rank)
  if not same then
    fail(("world_size mismatch: rank %d was started with world_size %d, rank %s with world_size %s"):format(
      rank, world_size, tostring(orank), tostring(ows)))
  end
  local holder = r[2][1]
  if holder ~= tostring(rank) then
    local other = tonumber(holder)
    fail(("RPC worker name %s is not unique. Workers %d and %d share the same name"):format(
      name, math.max(rank, other), math.min(rank, other)))
  end
  local loopback = store.is_loopback(assert(core.resolve(host)))
  local a = agentmod.new{name = name, rank = rank, world_size = world_size,
    timeout = tonumber(opts.rpc_timeout),
    num_worker_threads = opts.num_worker_threads, world = key .. "/" .. P, shm = opts.shm,
    max_queued_requests = opts.max_queued_requests,
    local_sockets = opts.local_sockets,
    -- Bytecode from the network can do anything: only a loopback-only world or one
    -- whose every peer proved the security token, or its user by MUNGE, takes it.
    allow_bytecode = loopback or require("rpchost.net.auth").token() ~= nil or
      require("rpchost.net.auth").munge_proven(client.cred)}
  local advertise = a:listen_near(client, loopback)
  agentmod.set_current(a)
  a.store, a.store_key, a.prefix = client, key, P
  local incarnation = rejoined and client:add(P .. "incarnation/" .. rank, 1) or 0
  a.incarnation = incarnation
  local ok, err = pcall(function()
    local record = codec.encode("info", {name = name, rank = rank, ip = advertise,
      port = a.port, unix = a.unix_path, version = core.version, proto = core.protocol_version,
      incarnation = incarnation, host = hosts.advertised()})
    local dir = client:gather(P .. "worker/", world_size, rank, record, {
      timeout = timeout, abort = abort, restarted = rejoined and true or nil,
      on_tick = check_duplicate, -- (the other may register after we first looked)
      hint = env.join_hint(),
      describe = function(miss)
        local ranks = {}
        for _, k in ipairs(miss) do ranks[#ranks + 1] = k:match("(%d+)$") end
        local what = ("rank%s %s to join"):format(#ranks > 1 and "s" or "", store.some(ranks))
        -- ranks that wait here for others still running the previous world: say
        -- so, rather than that rank 0 has not joined while rank 0 is alive
        local prev, still = ("rpc/%d/"):format(gen - 1), {}
        for _, r in ipairs(gen > 1 and ranks or {}) do
          if client:get(prev .. "worker/" .. r) and not client:get(prev .. "shutdown/" .. r) then still[#still + 1] = r end
        end
        if #still == 0 then return what end
        return ("%s; rank%s %s still run%s the previous world (%s), which this rank was not let into: " ..
          "a restarted rank rejoins it only once its earlier process is gone, so end that process if it " ..
          "still runs (stopped or hung), or restart every rank together"):format(what, #still > 1 and "s" or "",
          table.concat(still, ", "), #still > 1 and "" or "s", prev)
      end,
      -- (the rank that completes the rendezvous looks at every record once)
      build = function(recs)
        return agentmod.directory(recs, function(w)
          if w.version ~= core.version then
            return ("rpchost version mismatch: %s (rank %d) runs rpchost %s, %s (rank %d) runs rpchost %s"):format(
              tostring(w.name), w.rank, tostring(w.version), name, rank, core.version)
          end
        end)
      end,
    })
    a:use_directory(dir)
    if opts.devmaps then
      a.device_maps = device_maps.resolve(opts.devmaps, setmetatable({}, {__index = function(_, n)
        local p = a.by_name[n]
        return p and p.rank
      end}))
    end
  end)
  if not ok then
    a:close()
    agentmod.set_current(nil)
    error(err, 0)
  end
  rref.attach(a)
  require("rpchost.trace").set_rank(rank, name)
  a:set_ready()
  M.note_departures(a, rejoined)
  if rejoined then
    -- the others still know the dead incarnation's address: tell each where
    -- this one is (a peer that cannot be reached now learns it when it comes)
    local me = {name = name, rank = rank, ip = advertise, port = a.port, unix = a.unix_path,
                incarnation = incarnation, host = hosts.advertised()}
    for r = 0, world_size - 1 do
      if r ~= rank then pcall(a.post, a, r, "!reborn", me) end
    end
  end
  -- where dynamic members (rpchost repl) find this world
  if rank == 0 then
    client:set("rpc/current", codec.encode("world", {prefix = P, world_size = world_size, world = a.world}))
  end
end

-- Joins a running world without a rank of its own (a REPL, a tool): the store
-- gives it a fresh rank above the static ones and its peers learn of it when it
-- calls them or they look its name up.
function M.join_dynamic(name, opts, host, port, timeout)
  local client, key = store.acquire(host, port, false, timeout)
  local ok, err = pcall(function()
    client:wait_verbose({"rpc/current"}, timeout, nil, function() return "a running world" end)
    local cur = codec.decode(client:get("rpc/current"))
    local P = cur.prefix
    local rank = cur.world_size - 1 + client:add(P .. "dyn_next", 1)
    local holder = client:compare_set(P .. "name/" .. name, "", tostring(rank))
    -- a member that was killed never gave its name back: take over a name
    -- whose holder no longer answers at its address
    if holder ~= tostring(rank) and tonumber(holder) and tonumber(holder) >= cur.world_size
       and member_answers(client, cur.world, client:get(P .. "worker/" .. holder)) == false then
      client:delete(P .. "worker/" .. holder)
      holder = client:compare_set(P .. "name/" .. name, holder, tostring(rank))
    end
    if holder ~= tostring(rank) then
      error(errors.new("config", ("RPC worker name %s is already taken in the running world (by rank %s)"):format(
        name, holder)), 0)
    end
    local loopback = store.is_loopback(assert(core.resolve(host)))
    local a = agentmod.new{name = name, rank = rank, world_size = cur.world_size,
      timeout = tonumber(opts.rpc_timeout), num_worker_threads = opts.num_worker_threads,
      max_queued_requests = opts.max_queued_requests, world = cur.world, shm = opts.shm, local_sockets = opts.local_sockets, allow_bytecode = loopback or require("rpchost.net.auth").token() ~= nil or
      require("rpchost.net.auth").munge_proven(client.cred)}
    local advertise = a:listen_near(client, loopback)
    a.store, a.store_key, a.prefix, a.dynamic = client, key, P, true
    client:set(P .. "worker/" .. rank, codec.encode("info", {name = name, rank = rank, ip = advertise,
      port = a.port, unix = a.unix_path, version = core.version, proto = core.protocol_version,
      host = hosts.advertised()}))
    local keys = {}
    for r = 0, cur.world_size - 1 do keys[#keys + 1] = P .. "worker/" .. r end
    local infos = client:multi_get(keys)
    for r = 0, cur.world_size - 1 do
      if infos[r + 1] then a:add_peer(codec.decode(infos[r + 1])) end
    end
    a:add_peer({name = name, rank = rank, ip = advertise, port = a.port, host = hosts.advertised()})
    agentmod.set_current(a)
    rref.attach(a)
    require("rpchost.trace").set_rank(rank, name)
    a:set_ready()
  end)
  if not ok then
    agentmod.set_current(nil)
    store.release(key)
    error(err, 0)
  end
end

-- Waits until this worker has no call of its own out and serves none, telling
-- every progress interval what it waits for; false if `deadline` passed first.
local function until_idle(a, deadline, started)
  local every = store.progress_every()
  local next_note = sched.now() + every
  local nap = 0.002 -- (looked at again soon, then less often: a busy server may be busy for hours)
  while not a:idle() do
    if deadline and sched.now() >= deadline then return false end
    if sched.now() >= next_note then
      next_note = sched.now() + every
      local to = {}
      for _, call in pairs(a.pending) do to[call.peer.name] = (to[call.peer.name] or 0) + 1 end
      local parts = {}
      for name, n in pairs(to) do parts[#parts + 1] = ("%d to %s"):format(n, name) end
      table.sort(parts)
      log.info("shutdown: waiting for this worker's calls (%s) and the %d it serves (%d s)",
        #parts > 0 and table.concat(parts, ", ") or "none", a.running + a.nqueued, sched.now() - started)
    end
    sched.sleep(nap)
    nap = math.min(nap * 2, 0.05)
  end
  return true
end

-- Graceful shutdown, PyTorch's join: in rounds, each worker waits until it is
-- idle, then adds how many calls it has made to and taken from the other ranks
-- so far to the round's total at the store. A worker is idle only when none of
-- its calls is in flight, so new work can start after a worker reported only
-- from a worker that had not reported yet, and it moves that worker's counts.
-- Every count only grows, so when a round's total is the round before's,
-- nothing happened in between: all may close. (Made and taken are not compared
-- with each other: calls lost with a rank that died and restarted would never
-- balance.) No time limit unless one is given.
--
-- A round costs each rank a few store requests whatever the world's size: it
-- counts itself in (once, even when restarted), the rank that completes the
-- count says so in one key, which the others wait for. Waiting, each rank
-- looks every second at the few ranks after it (in rank order, from the first
-- not yet there) and probes those still missing: a rank that left without
-- shutting down (M.departure says how) is found by the ranks just before it, which tell the others
-- through the store. (Every rank waiting for, and probing, every rank still
-- missing made a world's shutdown cost the square of its size.)
local WATCHED = 8 -- ranks each waiting rank looks at per second

-- What a rank in graceful_join waits for, for its progress note and its
-- timeout: the ranks of `miss` (the store keys still missing, "...sd/<round>/<rank>"
-- or the round's total, "...sd/<round>/all") by name_of(rank).
function M.shutdown_wait_note(miss, name_of)
  local names = {}
  for _, k in ipairs(miss) do
    local r = tonumber(k:match("/(%d+)$"))
    if r then names[#names + 1] = name_of(r) end
  end
  -- (every rank counted in, and the rank that completed the count has not
  -- published the total yet: the wait is for the total key itself)
  if #names == 0 then return "the world's count of calls made and taken (every rank has counted in)" end
  return store.some(names) .. " to shut down"
end

-- Departures. A rank that leaves its world without rpc.shutdown() while its
-- process can still speak (its script ended or failed, or SIGTERM/SIGINT stopped
-- it) says so at the store on its way out, under P .. "left/<rank>", in words
-- that follow its name. A rank that leaves no such note died where nothing
-- could speak: killed (SIGKILL), crashed, or its host went away. A graceful
-- shutdown that finds a rank gone says which: only the note may blame the
-- script ("exited without calling rpc.shutdown()").
local function departure_note(a)
  local e = sched.main_error
  if e ~= nil then
    local first = tostring(errors.is(e) and e.message or e):match("^[^\n]*"):sub(1, 200)
    return "exited without calling rpc.shutdown(): its script failed: " .. first
  end
  return "exited without calling rpc.shutdown(): its script ended"
end

local function leave_note(a, text)
  -- (once: a signal's note is not overwritten by the os.exit that follows it)
  if a.state ~= "running" or a.dynamic or not a.store or a.left_noted then return end
  a.left_noted = true
  -- (said, not asked: at exit and in a signal's callback nothing may wait;
  -- what is queued is written before the process ends)
  pcall(a.store.tell, a.store, "set", a.prefix .. "left/" .. a.rank, text)
  core.flush()
end

-- Arms the notes for a joined static member (a rejoining one first takes back
-- the note its previous life left).
function M.note_departures(a, rejoined)
  if rejoined then pcall(a.store.tell, a.store, "delete", a.prefix .. "left/" .. a.rank) end
  sched.at_exit(function() leave_note(a, departure_note(a)) end)
  compat.before_exit(function()
    leave_note(a, "exited without calling rpc.shutdown(): its script called os.exit()")
  end)
  sched.on_terminate(function(self)
    leave_note(self, "was stopped by a signal (SIGTERM or SIGINT) before it called rpc.shutdown()")
  end, a)
end

-- Why rank r, found gone during a graceful shutdown, is gone, following its
-- name: its own note, else what the connection saw (`why`).
function M.departure(a, r, why)
  local ok, note = pcall(a.store.get, a.store, a.prefix .. "left/" .. r)
  if ok and type(note) == "string" and note ~= "" then return note end
  local p = a.peers[r]
  if p and p.silent then
    -- (a host that stopped answering: its process may well run on, cut off;
    -- nothing says it died)
    return ("cannot be reached: %s; its process may still be running, cut off from this host"):format(why)
  end
  return ("died before calling rpc.shutdown(), leaving no word (killed, crashed, or its host went away): %s"):format(
    why)
end

-- A store that is gone during a graceful shutdown took its host with it: in a
-- world started by hand that is rank 0 (under `rpchost run`, the launcher,
-- which stops the ranks itself): the error names it, at once.
local function store_gone(a, e)
  if not (errors.is(e) and e.kind == "unreachable" and a.rank ~= 0 and a.store) then return e end
  local msg = tostring(e.message)
  if not (msg:find("^the store at ") or msg:find("^lost the store at ")) then return e end
  local host, port = tostring(a.store.addr):match("^(.*):(%d+)$")
  if host and store.hosted_by_launcher(host, tonumber(port)) then return e end
  local name = a.peers[0] and a.peers[0].name or "?"
  return errors.new("unreachable", ("%s (its host, %s (rank 0), is gone: it died, exited or was cut off before " ..
    "the others were done; see its output)"):format(msg, name), {worker = name, rank = 0})
end

-- The store's wait ran out of the shutdown's time: said as the shutdown's
-- timeout, the one the program gave (the store's words give what was left of
-- it when the wait began, as a raw float).
local function gave_up(e, timeout)
  if not (errors.is(e) and e.kind == "timeout" and timeout) then return e end
  local what = tostring(e.message):match("^gave up after [^ ]+ s waiting for (.*)$")
  if not what then return e end
  return errors.new("timeout", ("shutdown gave up after %g s waiting for %s"):format(timeout, what),
    {worker = e.worker, rank = e.rank})
end

function M.graceful_join(a, timeout)
  local ok, e = pcall(M.graceful_join_, a, timeout)
  if not ok then error(gave_up(store_gone(a, e), timeout), 0) end
end

function M.graceful_join_(a, timeout)
  local start = sched.now()
  local deadline = timeout and start + timeout or nil
  local function left() return deadline and math.max(deadline - sched.now(), 0.001) or math.huge end
  local P, N = a.prefix, a.world_size
  local function name_of(r) return ("%s (rank %d)"):format(a.peers[r] and a.peers[r].name or "?", r) end
  local function rank_of(k) return tonumber(k:match("(%d+)$")) end
  local function gave_up(what)
    error(errors.new("timeout", ("shutdown gave up after %g s waiting for %s"):format(timeout, what)), 0)
  end
  local function dead(r, why)
    return ("%s %s"):format(name_of(r), M.departure(a, r, why))
  end
  local abort = P .. "sd/abort"
  local round, prev = 0, nil
  while true do
    round = round + 1
    repeat
      if not until_idle(a, deadline, start) then gave_up("this worker's outstanding calls") end
      -- give up the UserRRefs we hold; their owners free what nobody holds
      rref.flush()
      local had = rref.stats().user_forks > 0
      if had then rref.release_all() end
    until not had and a:idle()
    local st = a.stats
    -- the world's count of calls made and taken so far is summed at the store
    -- (each rank reading every rank's counters made shutdown's store traffic
    -- grow with N^2); the rank counts itself in after its add, so the sum is
    -- complete once every rank is counted
    -- (in one round trip; the rank that completes the count publishes the sum,
    -- once: every rank must decide on the same one)
    local R = ("%ssd/%d/"):format(P, round)
    local r = a.store:batch{{"add", R .. "calls", st.world_out + st.world_in},
                            {"count_in", R .. a.rank, a.inc, R .. "count"}}
    if r[2][1] >= N then a.store:compare_set(R .. "all", "", a.store:get(R .. "calls")) end
    local watch = (a.rank + 1) % N -- the first rank after this one not seen here yet
    local _, total = a.store:wait_for({R .. "all"}, {
      timeout = left(), abort = abort, fetch = true,
      describe = function(miss) return M.shutdown_wait_note(miss, name_of) end,
      missing = function()
        local keys = {}
        for r = 0, N - 1 do keys[#keys + 1] = R .. r end
        return a.store:missing(keys)
      end,
      on_tick = function()
        -- a rank that exited without shutting down never comes: say so now,
        -- here and (through the store) to every rank
        local keys = {}
        for i = 0, math.min(WATCHED, N - 1) - 1 do
          local r = (watch + i) % N
          if r == a.rank then break end
          keys[#keys + 1] = R .. r
        end
        if #keys == 0 then return end
        local missing = {}
        for _, k in ipairs(a.store:missing(keys)) do missing[k] = true end
        local moving = true
        local function found_gone(r, why)
          local msg = dead(r, why)
          pcall(a.store.set, a.store, abort, codec.encode("sd", {message = msg, rank = r}))
          error(errors.new("unreachable", msg, {worker = a.peers[r].name, rank = r}), 0)
        end
        local quiet = {} -- (missing, their connections open: their notes are asked for below)
        for _, k in ipairs(keys) do
          local r = rank_of(k)
          if not missing[k] then
            if moving then watch = (r + 1) % N end
          else
            moving = false
            local why = a:gone(r)
            if why then found_gone(r, why) end
            quiet[#quiet + 1] = r
          end
        end
        -- a rank that left while its process lives on (a store's host
        -- lingering for its clients keeps its connections open) said so
        if #quiet > 0 then
          local notes = {}
          for i, r in ipairs(quiet) do notes[i] = P .. "left/" .. r end
          local absent = {}
          for _, k in ipairs(a.store:missing(notes)) do absent[k] = true end
          for i, r in ipairs(quiet) do
            if not absent[notes[i]] then found_gone(r, "it left") end
          end
        end
      end,
      on_abort = function(raw)
        -- another rank found one that exited without shutting down
        local ok, v = pcall(codec.decode, raw)
        if ok and type(v) == "table" and type(v.message) == "string" then
          local r = tonumber(v.rank)
          error(errors.new("unreachable", v.message, {worker = r and a.peers[r] and a.peers[r].name, rank = r}), 0)
        end
      end,
    })
    total = tonumber(total or a.store:get(R .. "all"))
    if total == prev then break end
    prev = total
  end
  -- (said, not asked: nothing here depends on the answer, and in a big world
  -- the store answers a thousand ranks leaving at once slowly)
  a.store:tell("set", P .. "shutdown/" .. a.rank, "1")
end

return M
