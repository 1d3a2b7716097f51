-- rpchost.dist.hierarchy: collectives of a group that spans hosts, host by host.
--
-- The same-host paths (the collective arena, cross-memory reads) serve only
-- ranks of one kernel and PID namespace. A group with several ranks on each
-- of several hosts (the usual layout: N ranks per node) would otherwise run
-- every collective as messages between every rank: a small one as messages
-- between ranks of one host too, a large one's ring crossing the network once
-- per rank. Here such a group splits into one group per host (its members
-- there, in group order: their arena and memory) and one group of leaders
-- (each host's first member: messages between hosts), and an all_reduce,
-- broadcast or barrier runs within each host, then across the leaders, then
-- within each host again, as NCCL's and Horovod's hierarchical collectives do
-- (16 MiB over two ranks on each of two 1 Gbit hosts: 212 ms as one ring,
-- gloo's way, 146 ms host by host).
--
-- Every rank computes the same split from the world's directory, which says
-- the host of each rank (ranks of one kernel and PID namespace, as each
-- advertised them: rpchost.wire.directory, rpchost.net.hosts), so nothing is
-- exchanged to agree on it, and the sub-groups' ids follow from the group's.
-- Each sub-group checks its own calls against its members' (a rank that made
-- another call fails naming it) and takes its own sequence numbers.
--
-- A rank that makes another collective of the whole group meanwhile (an
-- all_gather where the others all_reduce) sends messages under the group's
-- own keys, which no wait of a sub-group looks at; and it may wait, without
-- sending, for ranks that are busy host by host. So a rank that has waited
-- LOOK seconds in a call it runs host by host looks, every LOOK seconds, for
-- the group's messages of that call in its mailbox (their sender made another
-- call), and once tells the rank it waits for, and the members it has a
-- connection to, that it runs the call host by host (an announcement under
-- the call's key: a member that made another call finds it in its own wait,
-- which in a split group looks every LOOK seconds too, or at its next
-- collective). Either names the mismatch to the whole group. A call that
-- finishes within LOOK costs nothing of this.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"

local M = {}

-- what ran host by host in this process (what specs look at)
M.used = {all_reduce = 0, broadcast = 0, barrier = 0, announced = 0}

-- Hosts of a group of n members from their hosts' keys (keys[i + 1]: group
-- rank i's, nil when unknown): an array of hosts in order of their first
-- member, each an array of group ranks in group order, and host_of[i + 1] =
-- index of i's host; nil when a key is unknown.
function M.partition(keys, n)
  local by_key, list, host_of = {}, {}, {}
  for i = 1, n do
    local k = keys[i]
    if k == nil then return nil end
    local h = by_key[k]
    if not h then
      list[#list + 1] = {}
      h = #list
      by_key[k] = h
    end
    local members = list[h]
    members[#members + 1] = i - 1
    host_of[i] = h
  end
  return list, host_of
end

-- (the index of a member's host in the world's directory, where every rank
-- reads the same: nil when unknown, a dynamic member for one)
local function host_of_member(g, i)
  local d = g.agent.dir
  return d and d:host_index(g:global(i))
end

-- Whether a split pays: more than one host, and some host with several members.
local function worth_it(list)
  if #list < 2 then return false end
  for _, members in ipairs(list) do
    if #members > 1 then return true end
  end
  return false
end

-- The split of group g, made on first use and kept on it: {here = this
-- host's group, leaders = the leaders' group (on leaders only), leader =
-- whether this rank is one, host_of = host index by group rank + 1, hosts =
-- the partition}; false for a group on one host, one rank per host, or with a
-- member whose host is unknown. new_group is rpchost.dist.collectives'.
function M.of(g, new_group)
  local h = g.hier
  if h ~= nil then return h end
  h = false
  -- (a world on one host, the usual one, looks no further)
  local d = g.agent.dir
  if g.size > 2 and d and (d.nhosts or 0) > 1 then
    local keys = {}
    for i = 0, g.size - 1 do keys[i + 1] = host_of_member(g, i) end
    local list, host_of = M.partition(keys, g.size)
    if list and worth_it(list) then
      local mine = host_of[g.rank + 1]
      local here = list[mine]
      local function globals(members)
        local out = {}
        for k, i in ipairs(members) do out[k] = g:global(i) end
        return out
      end
      local function index_in(members, i)
        for k, x in ipairs(members) do if x == i then return k - 1 end end
      end
      h = {hosts = list, host_of = host_of, leader = here[1] == g.rank,
           here = new_group(g.agent, g.id .. "h" .. mine, globals(here), index_in(here, g.rank), g.timeout)}
      if h.leader then
        local leaders = {}
        for k, members in ipairs(list) do leaders[k] = members[1] end
        h.leaders = new_group(g.agent, g.id .. "L", globals(leaders), mine - 1, g.timeout)
      end
      -- (their waits look at g's call; their failures stop all of g)
      for _, sub in pairs{h.here, h.leaders} do
        sub.split_of, sub.abort_to, sub.look_split = g, g.ranks, M.look_split
      end
    end
  end
  g.hier = h
  return h
end

-- how long a wait in a call run host by host goes before it looks (see above)
M.LOOK = 0.5
local SPLIT = "split" -- (the step an announcement is posted under)
local SPLIT_END = ":" .. SPLIT -- (how an announcement's key ends)

-- fn(...) runs group g's call c host by host: c is the call its sub-groups'
-- waits look at, and what g remembers of its last calls says it ran so. The
-- announcements of members that ran it so too go with it (one that comes
-- later goes at g's next collective).
function M.run(g, c, fn, ...)
  g.split_call = c
  local ss, sg = g.split_seq, g.split_sig
  if not ss then ss, sg = {}, {}; g.split_seq, g.split_sig = ss, sg end
  ss[c.seq % 16], sg[c.seq % 16] = c.seq, c.sig
  fn(...)
  if c.look_at then
    local a, key = g.agent, c.key .. SPLIT
    for _, r in ipairs(g.ranks) do a:take_mail(r, key, M.is_announcement) end
  end
end

function M.is_announcement(key) return key:sub(-#SPLIT_END) == SPLIT_END end

-- Whether g ran its call seq host by host, as the call signed sig (an
-- announcement's) was.
function M.ran_split(g, seq, sig)
  local ss = g.split_seq
  return ss ~= nil and ss[seq % 16] == seq and g.split_sig[seq % 16] == sig
end

-- Whether call c's wait should look now: the first time arms it, then at
-- most every LOOK seconds.
local function due(c)
  local now = sched.now()
  local at = c.look_at
  if at and now >= at then c.look_at = now + M.LOOK; return true end
  if not at then c.look_at = now + M.LOOK end
  return false
end

-- From a wait of sub-group sub for global rank waited (nil: none in
-- particular): nil, or the mismatch error when a member of the whole group
-- makes another call (see above). The announcement goes where a connection
-- is up (a close there could overtake no word) and to the rank waited for, not
-- to every member: a slow call of a big world would otherwise cost every pair
-- a message, and a connection.
function M.look_split(sub, waited)
  local g = sub.split_of
  local c = g and g.split_call
  if not (c and due(c)) then return nil end
  local a, prefix = g.agent, c.key
  local announcement = prefix .. SPLIT
  for _, r in ipairs(g.ranks) do
    if r ~= a.rank then
      -- (a rank makes one call under this key: one message shows which)
      local k, v = a:find_mail(r, prefix)
      local theirs = type(v) == "table" and v[1] or nil
      if k and (k ~= announcement or theirs ~= c.sig) then
        return g:signed_mismatch_error(c.meta, r, theirs)
      end
    end
  end
  if not c.announced then
    c.announced = true
    M.used.announced = M.used.announced + 1
    for _, r in ipairs(g.ranks) do
      local p = a.peers[r]
      if r ~= a.rank and (r == waited or (p and p.state == "ready" and not a.lost[r])) then
        pcall(a.post, a, r, announcement, c.sig)
      end
    end
    core.flush()
  end
  return nil
end

-- From a wait of split group g's own call c (one it does not run host by
-- host): nil, or the mismatch error when a member announced that it runs
-- this call host by host.
local function look_whole(g, c)
  if not due(c) then return nil end
  local a, announcement = g.agent, c.key .. SPLIT
  for _, r in ipairs(g.ranks) do
    if r ~= a.rank then
      local k, v = a:find_mail(r, announcement)
      if k then return g:signed_mismatch_error(c.meta, r, type(v) == "table" and v[1] or nil) end
    end
  end
  return nil
end

-- The receive of step `step` of call c from global rank src, for a group split
-- host by host or one of its sub-groups (pcall's results, as
-- Group:recv_value takes them): in slices of LOOK seconds, looking between
-- them, up to the group's timeout; a sender that stays silent for a
-- heartbeat is dialled (a loss fails the wait), as receive does.
function M.receive(g, c, src, step, on_other)
  local a = g.agent
  local limit = g.timeout and g.timeout > 0 and g.timeout or nil
  local start = sched.now()
  local deadline = limit and start + limit
  local hb = a.heartbeat and a.heartbeat > 0 and a.heartbeat or nil
  local next_gone = hb and start + hb
  while true do
    local left = deadline and deadline - sched.now()
    local slice = math.max(math.min(left or M.LOOK, M.LOOK), 0.001)
    local ends = sched.now() + slice
    local ok, meta, t = pcall(a.receive, a, src, c.key .. step, slice, c.what, c.key, on_other, c)
    -- (only this slice's own deadline goes on: an abort, a loss, a mismatch end it)
    if ok or meta == a.aborted or not (errors.is(meta) and meta.kind == "timeout" and sched.now() >= ends) then
      return ok, meta, t
    end
    if left and left <= M.LOOK then
      return false, errors.new("timeout", ("timed out after %g s waiting for %s from rank %d"):format(limit,
        c.what, src), {rank = src})
    end
    if next_gone and sched.now() >= next_gone then
      next_gone = sched.now() + hb
      a:gone(src)
    end
    local err
    if g.split_of then err = M.look_split(g, src) else err = look_whole(g, c) end
    if err then return false, err end
  end
end

-- all_reduce of the whole group on t (a flat contiguous view): this host's,
-- the leaders', then the leader's result to this host (the same bits on every
-- rank). AVG sums and divides once, by the group's size.
function M.all_reduce(t, g, h, redop)
  local op = redop == "AVG" and "SUM" or redop
  h.here:all_reduce(t, op)
  if h.leader then h.leaders:all_reduce(t, op) end
  h.here:broadcast(t, 0)
  if redop == "AVG" then core.t_binary(3, t, g.size, t) end
  M.used.all_reduce = M.used.all_reduce + 1
end

-- broadcast(t, root) of the whole group (root: a group rank): within the
-- root's host from the root, across the leaders from that host's, then within
-- every other host from its leader.
function M.broadcast(g, h, t, root)
  local from = h.host_of[root + 1]
  local mine = h.host_of[g.rank + 1]
  if mine == from then
    local members = h.hosts[from]
    for k, i in ipairs(members) do
      if i == root then h.here:broadcast(t, k - 1) break end
    end
  end
  if h.leader then h.leaders:broadcast(t, from - 1) end
  if mine ~= from then h.here:broadcast(t, 0) end
  M.used.broadcast = M.used.broadcast + 1
end

-- barrier of the whole group: every rank of this host is here, every host's
-- leader has heard from every other, and this host's ranks learn it.
function M.barrier(h)
  h.here:barrier()
  if h.leader then h.leaders:barrier() end
  h.here:barrier()
  M.used.barrier = M.used.barrier + 1
end

return M
