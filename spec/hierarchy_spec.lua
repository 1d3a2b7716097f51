-- How a group that spans hosts splits host by host (rpchost.dist.hierarchy):
-- every rank must make the same split from the world's directory alone (no
-- message is exchanged to agree on it), hosts in order of their first member,
-- members in group order, and a group the split would not help (one host, one
-- rank per host, two ranks, a member whose host is unknown) is left whole. The
-- directory says each rank's host (rpchost.wire.directory's host index, from
-- the kernel and PID namespace each rank advertised). The collectives
-- themselves run over simulated hosts in spec/multihost_spec.lua.
local hierarchy = require "rpchost.dist.hierarchy"
local directory = require "rpchost.wire.directory"
local hosts = require "rpchost.net.hosts"
local codec = require "rpchost.wire.codec"

-- a world's directory whose rank r advertised idents[r + 1] (false: nothing)
local function dir_of(idents)
  local recs = {}
  for i, s in ipairs(idents) do
    recs[i] = codec.encode("info", {name = "w" .. (i - 1), rank = i - 1, ip = "10.0.0.1", port = 40000 + i,
                                    host = s or nil})
  end
  return directory.open(assert(directory.build(recs, nil, hosts.memory_key_of)), #recs)
end

-- a group of the given global ranks over that directory, this process being
-- group rank me; new_group records the groups it made
local function group(ranks, me, d)
  local made = {}
  local g = {id = 7, ranks = ranks, rank = me, size = #ranks, timeout = 5, agent = {rank = ranks[me + 1], dir = d}}
  function g:global(i) return self.ranks[i + 1] end
  local function new_group(agent, id, rs, idx, timeout)
    local sub = {id = id, ranks = rs, rank = idx, timeout = timeout, agent = agent}
    made[#made + 1] = sub
    return sub
  end
  return g, new_group, made
end

describe("rpchost.dist.hierarchy #unit", function()
  -- identities of one kernel: h(1) this process's namespaces, h(k) others (a
  -- container, a simulated host: another host as far as memory goes)
  local function h(k) return ("1234-boot 40265 %d 40266 40267"):format(4026531835 + k) end
  -- world ranks 0..5: 0, 2 on host A; 1, 3 on B; 4 on C; 5 unknown ("?")
  local d = dir_of({h(1), h(2), h(1), h(2), h(3), "1234-boot 1 ? 3 4"})

  it("the directory says each rank's host, in order of its first rank, and how many", function()
    assert.are.same({1, 2, 1, 2, 3}, {d:host_index(0), d:host_index(1), d:host_index(2), d:host_index(3),
                                      d:host_index(4)})
    assert.is_nil(d:host_index(5)) -- (its PID namespace unknown)
    assert.is_nil(d:host_index(6))
    assert.are.equal(3, d.nhosts)
    -- a directory built without host keys says nothing of hosts
    local bare = directory.open(assert(directory.build({codec.encode("info",
      {name = "w0", rank = 0, ip = "10.0.0.1", port = 1})})), 1)
    assert.is_nil(bare:host_index(0))
    assert.is_nil(bare.nhosts)
  end)

  it("partitions by host, hosts in order of their first member", function()
    local list, host_of = hierarchy.partition({"a", "b", "a", "c", "b"}, 5)
    assert.are.same({{0, 2}, {1, 4}, {3}}, list)
    assert.are.same({1, 2, 1, 3, 2}, host_of)
    assert.is_nil(hierarchy.partition({"a", nil, "b"}, 3))
    assert.is_nil(hierarchy.partition({"a", "a", "b"}, 4)) -- (the last one unknown)
  end)

  it("splits a group of several ranks on several hosts; a host's first member leads it", function()
    local g, new_group, made = group({0, 1, 2, 3, 4}, 0, d)
    local s = hierarchy.of(g, new_group)
    assert.are.same({{0, 2}, {1, 3}, {4}}, s.hosts)
    assert.are.same({1, 2, 1, 2, 3}, s.host_of)
    assert.is_true(s.leader)
    assert.are.equal(2, #made)
    -- (their waits look at the whole group's call, and their failures stop all of it)
    local also = {split_of = g, abort_to = g.ranks, look_split = hierarchy.look_split}
    local function with(t) for k, v in pairs(also) do t[k] = v end return t end
    assert.are.same(with{id = "7h1", ranks = {0, 2}, rank = 0, timeout = 5, agent = g.agent}, s.here)
    assert.are.same(with{id = "7L", ranks = {0, 1, 4}, rank = 0, timeout = 5, agent = g.agent}, s.leaders)
    -- made once, kept on the group
    assert.are.equal(s, hierarchy.of(g, new_group))
    assert.are.equal(2, #made)
  end)

  it("gives a rank that leads no host its host's group only, with its index there", function()
    local g, new_group, made = group({1, 0, 3, 2, 4}, 2, d) -- (group rank 2 is world rank 3, on B after 1)
    local s = hierarchy.of(g, new_group)
    assert.is_false(s.leader)
    assert.is_nil(s.leaders)
    assert.are.equal(1, #made)
    assert.are.same({1, 3}, s.here.ranks)
    assert.are.equal(1, s.here.rank)
    assert.are.equal("7h1", s.here.id) -- (B is this group's first host)
  end)

  it("leaves whole a group on one host, with one rank per host, of two ranks, or with a host unknown", function()
    for k, ranks in ipairs({{0, 2}, {1, 3}, {0, 1, 4}, {0, 2, 1, 5}, {0, 2, 1, 6}}) do
      local g, new_group, made = group(ranks, 0, d)
      assert.is_false(hierarchy.of(g, new_group), "case " .. k)
      assert.are.equal(0, #made, "case " .. k)
    end
    -- a world on one host (the usual one) looks no further than its count of hosts
    local one = dir_of({h(1), h(1), h(1), h(1)})
    assert.are.equal(1, one.nhosts)
    local g, new_group = group({0, 1, 2, 3}, 0, one)
    assert.is_false(hierarchy.of(g, new_group))
  end)
end)
