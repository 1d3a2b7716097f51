-- torch.distributed as PyTorch's own process-group tests use it (distributed_test.py's
-- _DistTestBase, torch 1.13 with gloo), ported: the bitwise reductions, the flat
-- collectives FSDP and ZeRO live on, all_to_all, point to point from any rank,
-- irecv and batches, the object collectives, monitored_barrier, the group
-- sentinels and rank translations, and collectives matched in issue order. Each
-- runs in worlds of real processes of 2, 3 and 4 ranks, over the same-host fast
-- paths (direct reads of peers' memory, the shared-memory arena and rings) and
-- over TCP alone.
local S = require "spec.support"

local function run_world(n, body, opts)
  return S.world(n, S.prelude .. [[
    local tensor = require "tensor"
    local dist = require "dist"
    local rank = tonumber(os.getenv "RANK")
    dist.init_process_group{backend = "gloo"}
    local n = dist.get_world_size()
  ]] .. body .. [[
    dist.destroy_process_group()
  ]], opts)
end

local function assert_clean(r)
  assert.are.equal(0, r.status, r.out .. r.err)
  S.assert_checks(r)
end

-- what every world runs, with exact expected values computed on each rank
local EVERY = [[
  -- 1. bitwise reductions on integer and bool tensors; floats refused
  for _, dt in ipairs({"int32", "int64", "uint8"}) do
    local x = tensor.tensor({bit.lshift(1, rank), 255, rank % 2}, {dtype = tensor[dt]})
    local a, o, xo = x:clone(), x:clone(), x:clone()
    dist.all_reduce(a, dist.ReduceOp.BAND)
    dist.all_reduce(o, dist.ReduceOp.BOR)
    dist.all_reduce(xo, dist.ReduceOp.BXOR)
    local all_bits, par = 0, 0
    for r = 0, n - 1 do all_bits = bit.bor(all_bits, bit.lshift(1, r)); par = bit.bxor(par, r % 2) end
    check("BAND " .. dt, a:tolist()[1] == (n == 1 and 1 or 0) and a:tolist()[2] == 255 and a:tolist()[3] == (n == 1 and 0 or 0), a)
    check("BOR " .. dt, o:tolist()[1] == all_bits and o:tolist()[3] == (n > 1 and 1 or 0), o)
    check("BXOR " .. dt, xo:tolist()[1] == all_bits and xo:tolist()[2] == (n % 2 == 1 and 255 or 0) and xo:tolist()[3] == par, xo)
  end
  local b = tensor.tensor({true, rank == 0, false})
  local bx = b:clone()
  dist.all_reduce(b, dist.ReduceOp.BAND)
  dist.all_reduce(bx, dist.ReduceOp.BXOR)
  check("BAND bool", b:tolist()[1] == true and b:tolist()[2] == (n == 1) and b:tolist()[3] == false, b)
  check("BXOR bool", bx:tolist()[1] == (n % 2 == 1) and bx:tolist()[2] == true, bx)
  local ok, e = pcall(dist.all_reduce, tensor.ones(2), dist.ReduceOp.BOR)
  check("BOR on floats refused", not ok and tostring(e.message):find("Cannot use ReduceOp.BOR with non-integral dtype", 1, true), e)
  local red = tensor.tensor({6, 3}, {dtype = tensor.int64})
  dist.reduce(red, 0, dist.ReduceOp.BAND)
  if rank == 0 then check("reduce BAND", red:tolist()[1] == 6 and red:tolist()[2] == 3, red) end

  -- 2. Work:get_future
  local w = dist.all_reduce(tensor.ones(4), {async_op = true})
  local f = w:get_future():next(function(fut) return fut:wait():sum():item() end)
  check("get_future chains", f:wait() == 4 * n and w:is_completed() and w:exception() == nil)

  -- 3. all_gather_into_tensor, flat and stacked; reduce_scatter_tensor; their aliases
  for _, k in ipairs({3, 70000}) do
    local t = tensor.arange(k):float() + rank * 1000
    local flat, stacked = tensor.zeros(n * k), tensor.zeros(n, k)
    dist.all_gather_into_tensor(flat, t)
    dist._all_gather_base(stacked, t)
    local good = true
    for r = 0, n - 1 do
      local want = tensor.arange(k):float() + r * 1000
      good = good and flat:narrow(1, r * k + 1, k):equal(want) and stacked[r + 1]:equal(want)
    end
    check("all_gather_into_tensor " .. k, good)
    local inp = tensor.arange(n * k):double() * (rank + 1)
    local out, avg = tensor.zeros(k, {dtype = tensor.float64}), tensor.zeros(k, {dtype = tensor.float64})
    dist.reduce_scatter_tensor(out, inp)
    dist._reduce_scatter_base(avg, inp, dist.ReduceOp.AVG)
    local mine = tensor.arange(rank * k, (rank + 1) * k):double()
    local s = n * (n + 1) / 2
    check("reduce_scatter_tensor " .. k, out:equal(mine * s) and avg:allclose(mine * s / n))
  end
  local ints = tensor.full({n * 2}, rank + 1, {dtype = tensor.int32})
  local io = tensor.zeros(2, {dtype = tensor.int32})
  dist.reduce_scatter_tensor(io, ints, dist.ReduceOp.MAX)
  check("reduce_scatter_tensor MAX int32", io:tolist()[1] == n and io:tolist()[2] == n, io)
  ok, e = pcall(dist.all_gather_into_tensor, tensor.zeros(n * 3 + 1), tensor.zeros(3))
  check("all_gather_into_tensor size checked", not ok and tostring(e.message):find("world_size x the input's", 1, true), e)
  ok, e = pcall(dist.reduce_scatter_tensor, tensor.zeros(2), tensor.zeros(n * 2, {dtype = tensor.float64}))
  check("reduce_scatter_tensor dtype checked", not ok and tostring(e.message):find("same dtype", 1, true), e)

  -- 4. all_to_all_single: equal and unequal splits (rank r sends r + 1 rows to each)
  local eq_in = tensor.arange(n * 2):float() + rank * 100
  local eq_out = tensor.zeros(n * 2)
  dist.all_to_all_single(eq_out, eq_in)
  local good = true
  for r = 0, n - 1 do
    good = good and eq_out:narrow(1, r * 2 + 1, 2):equal(tensor.arange(rank * 2, rank * 2 + 2):float() + r * 100)
  end
  check("all_to_all_single equal", good)
  for _, cols in ipairs({1, 30000}) do
    local in_splits, out_splits = {}, {}
    for r = 0, n - 1 do in_splits[r + 1] = rank + 1; out_splits[r + 1] = r + 1 end
    local rows_in, rows_out = n * (rank + 1), n * (n + 1) / 2
    local inp = (tensor.arange(rows_in * cols):float() + rank * 1e6):view(rows_in, cols)
    local out = tensor.zeros(rows_out, cols)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    good = true
    local at = 1
    for r = 0, n - 1 do
      local rows = r + 1
      local want = (tensor.arange(rank * rows * cols, (rank + 1) * rows * cols):float() + r * 1e6):view(rows, cols)
      good = good and out:narrow(1, at, rows):equal(want)
      at = at + rows
    end
    check("all_to_all_single unequal " .. cols, good)
  end
  -- 5. all_to_all with sizes that differ from pair to pair
  local ins, outs = {}, {}
  for r = 0, n - 1 do
    ins[r + 1] = tensor.full({rank + r + 1}, rank * 10 + r, {dtype = tensor.int64})
    outs[r + 1] = tensor.zeros(rank + r + 1, {dtype = tensor.int64})
  end
  dist.all_to_all(outs, ins)
  good = true
  for r = 0, n - 1 do good = good and outs[r + 1]:equal(tensor.full({rank + r + 1}, r * 10 + rank, {dtype = tensor.int64})) end
  check("all_to_all", good)

  -- 6. group ranks
  check("get_group_rank of WORLD", dist.get_group_rank(dist.GroupMember.WORLD, rank) == rank)
  check("get_global_rank of WORLD", dist.get_global_rank(dist.GroupMember.WORLD, n - 1) == n - 1)

  -- 17. GroupMember.WORLD's rank and size
  check("WORLD rank and size", dist.get_rank(dist.GroupMember.WORLD) == rank and dist.get_world_size(dist.GroupMember.WORLD) == n)

  -- 7, 8. recv from any rank, irecv: every other rank sends to rank 0 twice
  -- (messages from different senders may come in any order; each sender's
  -- two in its order)
  if rank == 0 then
    local count, good_values = {}, true
    local function took(from, t)
      count[from] = (count[from] or 0) + 1
      good_values = good_values and t:equal(tensor.full({3}, from * 10 + count[from]))
    end
    for _ = 1, n - 1 do
      local t = tensor.zeros(3)
      took(dist.recv(t), t)
    end
    for _ = 1, n - 1 do
      local t = tensor.zeros(3)
      local wr = dist.irecv(t)
      wr:wait()
      took(wr:source_rank(), t)
    end
    local all = good_values
    for r = 1, n - 1 do all = all and count[r] == 2 end
    check("recv from any rank, then irecv from any rank", all)
  else
    dist.send(tensor.full({3}, rank * 10 + 1), 0)
    dist.isend(tensor.full({3}, rank * 10 + 2), 0):wait()
  end
  -- an irecv takes its place when made: the first message is the irecv's
  if n > 1 then
    if rank == 1 then
      dist.send(tensor.full({1}, 1), 0, {tag = 3})
      dist.send(tensor.full({1}, 2), 0, {tag = 3})
    elseif rank == 0 then
      local a, b = tensor.zeros(1), tensor.zeros(1)
      local wa = dist.irecv(a, 1, {tag = 3})
      dist.recv(b, 1, {tag = 3})
      wa:wait()
      check("irecv takes its place when made", a:item() == 1 and b:item() == 2 and wa:source_rank() == 1)
    end
  end

  -- 9. batch_isend_irecv: a ring exchange, and the tags form
  local p2p = {}
  local recvs = {}
  for r = 0, n - 1 do
    if r ~= rank then
      recvs[r] = tensor.zeros(r + 1)
      p2p[#p2p + 1] = dist.P2POp(dist.irecv, recvs[r], r, nil, r)
      p2p[#p2p + 1] = dist.P2POp(dist.isend, tensor.full({rank + 1}, rank), r, nil, rank)
    end
  end
  if #p2p > 0 then
    for _, wk in ipairs(dist.batch_isend_irecv(p2p)) do wk:wait() end
  end
  good = true
  for r, t in pairs(recvs) do good = good and t:equal(tensor.full({r + 1}, r)) end
  check("batch_isend_irecv", good)
  ok, e = pcall(dist.batch_isend_irecv, {1, 2})
  check("batch_isend_irecv refuses non-ops", not ok and tostring(e.message):find("Invalid ``p2p_op_list``", 1, true), e)
  ok, e = pcall(dist.P2POp, dist.broadcast, tensor.ones(1), 0)
  check("P2POp refuses other ops", not ok and tostring(e.message):find("Invalid ``op``", 1, true), e)

  -- 10-13. objects
  local objs = {}
  dist.all_gather_object(objs, {rank = rank, name = "r" .. rank, t = tensor.full({2}, rank)})
  good = #objs == n
  for r = 0, n - 1 do good = good and objs[r + 1].rank == r and objs[r + 1].name == "r" .. r and objs[r + 1].t:equal(tensor.full({2}, r)) end
  check("all_gather_object", good)
  local gathered = rank == 0 and {} or nil
  dist.gather_object({r = rank, s = ("x"):rep(rank * 100)}, gathered, 0)
  if rank == 0 then
    good = #gathered == n
    for r = 0, n - 1 do good = good and gathered[r + 1].r == r and #gathered[r + 1].s == r * 100 end
    check("gather_object", good)
  end
  local bl = rank == n - 1 and {"a", {b = 2}, 3, tensor.ones(2)} or {"stale", "stale", "stale", "stale", "stale"}
  dist.broadcast_object_list(bl, n - 1)
  check("broadcast_object_list", #bl == 4 and bl[1] == "a" and bl[2].b == 2 and bl[3] == 3 and bl[4]:equal(tensor.ones(2)))
  local scatter_in = nil
  if rank == 0 then
    scatter_in = {}
    for r = 0, n - 1 do scatter_in[r + 1] = {for_rank = r, pad = ("y"):rep(r * 50)} end
  end
  local sout = {}
  dist.scatter_object_list(sout, scatter_in, 0)
  check("scatter_object_list", sout[1].for_rank == rank and #sout[1].pad == rank * 50)

  -- 19. a rank outside a group: the one sentinel; collectives on it do nothing
  local sub = dist.new_group({0})
  if rank == 0 then
    check("member gets a group", sub ~= dist.GroupMember.NON_GROUP_MEMBER and dist.get_world_size(sub) == 1)
    check("member's group rank", dist.get_group_rank(sub, 0) == 0 and dist.get_global_rank(sub, 0) == 0)
    if n > 1 then
      ok, e = pcall(dist.get_group_rank, sub, n - 1)
      check("get_group_rank outside", not ok and tostring(e.message):find("is not part of group", 1, true), e)
      ok, e = pcall(dist.get_global_rank, sub, 1)
      check("get_global_rank outside", not ok and tostring(e.message):find("is not part of group", 1, true), e)
    end
  else
    -- 18. the sentinel itself
    check("outsider gets NON_GROUP_MEMBER", sub == dist.GroupMember.NON_GROUP_MEMBER and dist.new_group({0}) == sub)
    local t = tensor.ones(2)
    check("collective on a group this rank is not in does nothing",
      dist.all_reduce(t, {group = sub}) == nil and t:equal(tensor.ones(2)) and dist.barrier(sub) == nil
      and dist.broadcast(t, 0, {group = sub}) == nil and dist.monitored_barrier(sub, 1) == nil)
    check("rank and size outside", dist.get_rank(sub) == -1 and dist.get_world_size(sub) == -1)
    -- 20. get_backend(group)
    ok, e = pcall(dist.get_backend, sub)
    check("get_backend outside", not ok and tostring(e.message):find("Invalid process group specified", 1, true), e)
  end
  check("get_backend of the world", dist.get_backend() == "gloo" and dist.get_backend(dist.GroupMember.WORLD) == "gloo")
  -- (the member's own new_group({0}) above paired with the outsiders' first: one more for the outsiders' second)
  if rank == 0 and n > 1 then dist.new_group({0}) end

  -- 14. monitored_barrier passes when everyone comes
  dist.monitored_barrier{timeout = 20}
  dist.monitored_barrier{timeout = 20, wait_all_ranks = true}
  check("monitored_barrier passes", true)
  print("ok world " .. n)
]]

describe("c10d #world", function()
  for _, n in ipairs({2, 3, 4}) do
    it(("behaves as PyTorch's process-group tests in a world of %d over the same-host fast paths"):format(n), function()
      -- (direct reads from 64 KiB on: both the direct and the message paths run)
      local r = run_world(n, EVERY, {timeout = 180, env = {RPCHOST_DIRECT_BYTES = 65536}})
      assert_clean(r)
    end)
    it(("behaves as PyTorch's process-group tests in a world of %d over TCP alone"):format(n), function()
      local r = run_world(n, EVERY, {timeout = 180, env = {RPCHOST_UNIX = 0, RPCHOST_SHM = 0, RPCHOST_CMA = 0,
        RPCHOST_SHM_COLL = 0, RPCHOST_SHM_RING = 0}})
      assert_clean(r)
    end)
  end

  it("reads large pieces straight from the peers' memory on one host", function()
    local r = run_world(3, [[
      local used = require("rpchost.dist.collectives").used
      -- (connections between every pair first: what each can do with the
      -- others' memory is known once they exist)
      dist.all_gather_into_tensor(tensor.zeros(3), tensor.zeros(1))
      local before = used.direct
      local t = tensor.full({300000}, rank + 1)
      local out = tensor.zeros(3 * 300000)
      dist.all_gather_into_tensor(out, t)
      dist.reduce_scatter_tensor(tensor.zeros(300000), tensor.ones(3 * 300000))
      dist.all_to_all_single(tensor.zeros(3 * 300000), tensor.ones(3 * 300000))
      check("three direct calls", used.direct - before == 3, used.direct - before)
      check("exact", out:sum():item() == 300000 * 6)
    ]], {timeout = 120})
    assert_clean(r)
  end)

  -- 16. the ordering bug: an async collective takes its place when issued
  it("matches collectives in the order each rank issues them, async or not", function()
    local r = run_world(3, [[
      local rpc = require "rpc"
      for i = 1, 20 do
        local x = tensor.full({3}, rank + 1)
        local w = dist.all_reduce(x, {async_op = true})
        if rank == i % 3 then rpc.sleep(0.02) end
        local y = tensor.full({2}, rank)
        dist.broadcast(y, 0)
        local z = tensor.full({1}, rank)
        local w2 = dist.all_reduce(z, dist.ReduceOp.MAX, {async_op = true})
        dist.barrier()
        w:wait()
        w2:wait()
        if not (x:equal(tensor.full({3}, 6)) and y:equal(tensor.zeros(2)) and z:item() == 2) then
          print("FAIL round " .. i)
        end
      end
      check("issue order kept", true)
    ]], {timeout = 120})
    assert_clean(r)
  end)

  -- (the rank with the bad argument raises naming it; a rank whose part waits
  -- on that rank raises at once with the same words: a scatter's root waits on
  -- no one, and finishes)
  it("fails every rank at once when one passes a list a non-root must not pass (gather, scatter)", function()
    for _, case in ipairs({
      {"gather", "dist.gather(tensor.ones(2), {tensor.zeros(2), tensor.zeros(2)}, 0)",
       "Argument ``gather_list`` must NOT be specified on non-destination ranks.", 2},
      {"scatter", "dist.scatter(tensor.zeros(2), {tensor.ones(2), tensor.ones(2)}, 0)",
       "Argument ``scatter_list`` must NOT be specified on non-source ranks.", 1},
      {"gather without list", "dist.gather(tensor.ones(2), nil, 0)",
       "Argument ``gather_list`` must be specified on destination rank.", 1},
      {"scatter without list", "dist.scatter(tensor.zeros(2), nil, 0)",
       "Argument ``scatter_list`` must be specified on source rank.", 2},
    }) do
      local body = ([[
        local sched = require "rpchost.sched"
        local t0 = sched.now()
        local ok, e = pcall(function() %s end)
        local msg = tostring(type(e) == "table" and e.message or e)
        print(("rank %%d failed=%%s in %%.1f s: %%s"):format(rank, tostring(not ok), sched.now() - t0, msg))
        if not ok then check("named", msg:find(%q, 1, true) ~= nil, msg) end
        check("at once", sched.now() - t0 < 10)
      ]]):format(case[2], case[3])
      local r = S.world(2, S.prelude .. [[
        local tensor = require "tensor"
        local dist = require "dist"
        local rank = tonumber(os.getenv "RANK")
        dist.init_process_group{backend = "gloo", timeout = 60}
      ]] .. body, {timeout = 60})
      assert.are.equal(0, r.status, case[1] .. "\n" .. r.out .. r.err)
      S.assert_checks(r)
      local named = select(2, r.out:gsub("ok named", ""))
      assert.are.equal(case[4], named, case[1] .. "\n" .. r.out)
    end
  end)

  it("raises on the rank with an unsendable object and names it everywhere else, at once", function()
    local r = run_world(3, [[
      local sched = require "rpchost.sched"
      local t0 = sched.now()
      local obj = rank == 1 and {f = io.stdout} or {rank = rank}
      local ok, e = pcall(dist.all_gather_object, {}, obj)
      local msg = tostring(type(e) == "table" and e.message or e)
      if rank == 1 then check("the owner says why", not ok and msg:find("this rank's object cannot be sent", 1, true), msg)
      else check("the others name rank 1", not ok and msg:find("rank 1's object cannot be sent", 1, true), msg) end
      check("at once", sched.now() - t0 < 10)
      -- the group goes on
      local x = tensor.ones(1)
      dist.all_reduce(x)
      check("the group goes on", x:item() == 3)
      ok, e = pcall(dist.scatter_object_list, {}, rank == 0 and {} or nil, 0)
      msg = tostring(type(e) == "table" and e.message or e)
      if rank == 0 then check("empty input list refused", not ok and msg:find("one object per rank", 1, true), msg)
      else check("others told about the empty input list", not ok and msg:find("rank 0's object cannot be sent", 1, true), msg) end
      ok, e = pcall(dist.scatter_object_list, nil, {}, 0)
      check("output list required", not ok and tostring(e.message):find("scatter_object_output_list", 1, true), e)
    ]], {timeout = 60})
    assert_clean(r)
  end)

  -- (the arena's exchange reuses one tensor of numbers per group: each call's
  -- must be its own, whatever the calls before it said)
  -- (the numbers through the arena, or by messages where it is off)
  for _, case in ipairs({{false, true}, {true, true}, {true, false}}) do
    local direct, arena = case[1], case[2]
    it(("gives all_to_all_single's pieces call after call, splits changing, zeros and dtypes too%s%s"):format(
        direct and ", read straight from the peers" or ", as messages",
        arena and "" or ", their addresses told by messages"), function()
      local r = run_world(3, [[
        local used = require("rpchost.dist.collectives").used
        -- (connections between every pair first: what each can do with the
        -- others' memory is known once they exist)
        dist.all_gather_into_tensor(tensor.zeros(3), tensor.zeros(1))
        local before = used.direct
        -- rank r sends (r + j + k) % 3 rows of 5 to rank j in call k: some pieces empty
        local function rows(from, to, k) return (from + to + k) % 3 end
        local calls = 0
        for k = 0, 5 do
          for _, dt in ipairs({"float32", "int64", "float64"}) do
            local in_splits, out_splits, rin, rout = {}, {}, 0, 0
            for j = 0, n - 1 do
              in_splits[j + 1], out_splits[j + 1] = rows(rank, j, k), rows(j, rank, k)
              rin, rout = rin + in_splits[j + 1], rout + out_splits[j + 1]
            end
            -- element e of the piece for j: rank * 1e6 + j * 1e4 + k * 100 + e
            local inp = tensor.zeros(rin, 5, {dtype = tensor[dt]})
            local at = 0
            for j = 0, n - 1 do
              for e = 0, in_splits[j + 1] * 5 - 1 do
                inp:view(-1)[at + e + 1] = rank * 1e6 + j * 1e4 + k * 100 + e
              end
              at = at + in_splits[j + 1] * 5
            end
            local out = tensor.full({rout, 5}, -1, {dtype = tensor[dt]})
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            calls = calls + 1
            local good, o = true, 0
            for j = 0, n - 1 do
              for e = 0, out_splits[j + 1] * 5 - 1 do
                good = good and out:view(-1)[o + e + 1]:item() == j * 1e6 + rank * 1e4 + k * 100 + e
              end
              o = o + out_splits[j + 1] * 5
            end
            check("pieces right in call " .. k .. " " .. dt, good, tostring(out))
          end
        end
        check("direct " .. tostring(used.direct - before), true)
      ]], {timeout = 90, env = {RPCHOST_DIRECT_BYTES = direct and 1 or nil, RPCHOST_SHM_COLL = not arena and "0" or nil}})
      assert_clean(r)
      -- (every call read straight from the peers, or none did)
      assert.truthy(r.out:find(direct and "ok direct 18" or "ok direct 0", 1, true), r.out)
    end)
  end

  it("names the splits that disagree before any data moves", function()
    local r = run_world(2, [[
      local out_splits = rank == 0 and {1, 3} or {1, 1}
      local ok, e = pcall(dist.all_to_all_single, tensor.zeros(rank == 0 and 4 or 2), tensor.zeros(2), out_splits, {1, 1})
      local msg = tostring(type(e) == "table" and e.message or e)
      check("split mismatch named", not ok and msg:find("rank 1 sends 1 element to rank 0, but rank 0 expects 3", 1, true), msg)
    ]], {timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    assert.truthy(r.out:find("ok split mismatch named", 1, true), r.out .. r.err)
  end)

  it("names the ranks that miss a monitored_barrier (PyTorch's messages)", function()
    local r = run_world(3, [[
      -- rank 1 stays away: rank 0 names it; rank 2 came, and says so
      if rank ~= 1 then
        local ok, e = pcall(dist.monitored_barrier, {timeout = 1})
        local msg = tostring(type(e) == "table" and e.message or e)
        if rank == 0 then check("Rank 1 failed", not ok and msg:find("Rank 1 failed to pass monitoredBarrier in 1000 ms", 1, true), msg)
        else check("rank 2 reached it", not ok and msg:find("Rank 2 successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0", 1, true), msg) end
      end
      dist.barrier()
      -- only rank 0 comes, waiting for all: both named
      if rank == 0 then
        local ok, e = pcall(dist.monitored_barrier, {timeout = 0.5, wait_all_ranks = true})
        check("Ranks 1, 2 failed", not ok and tostring(e.message):find("Ranks 1, 2 failed to pass monitoredBarrier in 500 ms", 1, true), e)
        ok, e = pcall(dist.monitored_barrier, {timeout = 0})
        check("timed out after 0 ms", not ok and tostring(e.message):find("Rank 0 timed out in monitoredBarrier after 0 ms", 1, true), e)
      end
      dist.barrier()
      -- a subgroup with a member away (test_monitored_barrier_gloo_subgroup)
      local sub = dist.new_group({0, 1})
      if rank == 0 then
        local ok, e = pcall(dist.monitored_barrier, sub, 0.2)
        check("subgroup names rank 1", not ok and tostring(e.message):find("Rank 1 failed to pass monitoredBarrier", 1, true), e)
      elseif rank == 2 then
        check("outsider passes", dist.monitored_barrier(sub, 0.2) == nil)
      end
      dist.barrier()
      check("collectives still in step", true)
    ]], {timeout = 60})
    assert_clean(r)
  end)
end)
