-- How a group that spans hosts splits host by host (rpchost.dist.hierarchy):
-- every rank must make the same split from the world's directory alone (no
-- message is exchanged to agree on it), hosts in order of their first member,
-- members in group order, and a group the split would not help (one host, one
-- rank per host, a member whose host is unknown) is left whole. The
-- collectives themselves run over simulated hosts in spec/multihost_spec.lua.
local hierarchy = require "rpchost.dist.hierarchy"
local hosts = require "rpchost.net.hosts"

-- a group of the given global ranks whose members advertise idents[r] (this
-- process's own identity for rank `me_global`); new_group records what it made
local function group(ranks, me, idents)
  local made = {}
  local peers = {}
  for r, s in pairs(idents) do peers[r] = {host = s} end
  local g = {id = 7, ranks = ranks, rank = me, size = #ranks, timeout = 5,
             agent = {rank = ranks[me + 1], peers = peers}}
  function g:global(i) return self.ranks[i + 1] end
  local function new_group(agent, id, rs, idx, timeout)
    local sub = {id = id, ranks = rs, rank = idx, timeout = timeout, agent = agent}
    made[#made + 1] = sub
    return sub
  end
  return g, new_group, made
end

describe("rpchost.dist.hierarchy #unit", function()
  local mine = hosts.advertised()
  local boot = hosts.parse(mine).boot
  local function other(pidns) return ("%s 1 %d 3 4"):format(boot, pidns) end

  it("partitions by kernel and PID namespace, hosts in order of their first member", function()
    local list, host_of = hierarchy.partition({"a", "b", "a", "c", "b"}, 5)
    assert.are.same({{0, 2}, {1, 4}, {3}}, list)
    assert.are.same({1, 2, 1, 3, 2}, host_of)
    assert.is_nil(hierarchy.partition({"a", nil, "b"}, 3))
    assert.is_nil(hierarchy.partition({"a", "a", "b"}, 4)) -- (the last one unknown)
  end)

  -- global ranks 10..14: 10 and 12 here (this process's namespaces); 11 and 13
  -- in another PID namespace of the same kernel (a container: another host as
  -- far as memory goes); 14 alone in a third
  local idents = {[10] = mine, [11] = other(901), [12] = mine, [13] = other(901), [14] = other(902)}

  it("splits a group of several ranks on several hosts; a host's first member leads it", function()
    local g, new_group, made = group({10, 11, 12, 13, 14}, 0, idents)
    local h = hierarchy.of(g, new_group)
    assert.are.same({{0, 2}, {1, 3}, {4}}, h.hosts)
    assert.are.same({1, 2, 1, 2, 3}, h.host_of)
    assert.is_true(h.leader)
    assert.are.equal(2, #made)
    assert.are.same({id = "7h1", ranks = {10, 12}, rank = 0, timeout = 5, agent = g.agent}, h.here)
    assert.are.same({id = "7L", ranks = {10, 11, 14}, rank = 0, timeout = 5, agent = g.agent}, h.leaders)
    -- made once, kept on the group
    assert.are.equal(h, hierarchy.of(g, new_group))
    assert.are.equal(2, #made)
  end)

  it("gives a rank that leads no host its host's group only, with its index there", function()
    local g, new_group, made = group({10, 11, 12, 13, 14}, 2, idents)
    local h = hierarchy.of(g, new_group)
    assert.is_false(h.leader)
    assert.is_nil(h.leaders)
    assert.are.equal(1, #made)
    assert.are.same({10, 12}, h.here.ranks)
    assert.are.equal(1, h.here.rank)
  end)

  it("leaves whole a group on one host, with one rank per host, of two ranks, or with a host unknown", function()
    local cases = {
      {{10, 12}, {[10] = mine, [12] = mine}},
      {{10, 12, 20}, {[10] = mine, [12] = mine, [20] = mine}},
      {{10, 11, 14}, {[10] = mine, [11] = other(901), [14] = other(902)}},
      {{10, 11, 12, 13}, {[10] = mine, [11] = other(901), [12] = mine, [13] = "?"}},
      {{10, 11, 12}, {[10] = mine, [11] = other(901), [12] = mine, [13] = nil}},
    }
    cases[5][1] = {10, 11, 12, 13} -- (13 has no record: a dynamic member)
    for k, case in ipairs(cases) do
      local g, new_group, made = group(case[1], 0, case[2])
      assert.is_false(hierarchy.of(g, new_group), "case " .. k)
      assert.are.equal(0, #made, "case " .. k)
    end
  end)
end)
