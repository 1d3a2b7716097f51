-- The "mpi" process-group backend over real `mpirun` worlds of 2-4 ranks
-- (Open MPI, as scripts/setup.sh installs it): every collective x dtype against
-- exact values, async Works, subgroups, point to point, rpc.init_rpc in the same
-- processes with the store's address sent through MPI, a mismatched collective
-- named on every rank, a rank that never calls bounded by the timeout, and the
-- errors for a library that is missing or not Open MPI. Also (issue 32) the
-- bitwise reductions, all_gather_into_tensor and reduce_scatter_tensor,
-- all_to_all_single and all_to_all with uneven splits (a mismatched split named
-- on every rank), and receives from any rank that say who sent.
local S = require "spec.support"
local core = require "rpchost.core"

local MPIRUN = "/usr/bin/mpirun"

-- mpirun -np n rpchost <prelude .. body>: the result table
local function mpi_world(n, body, opts)
  opts = opts or {}
  local path = S.write([==[
local rpc = require "rpc"
local dist = require "dist"
local tensor = require "tensor"
local function at(t, ...)
  local v = t:totable()
  for _, i in ipairs({...}) do v = v[i] end
  return v
end
local function check(name, cond, why)
  print((cond and "ok " or "FAIL ") .. name .. (cond and "" or (": " .. tostring(why))))
end
]==] .. body)
  -- (under the sanitizer build, LeakSanitizer would report Open MPI's own
  -- allocations, which its components keep until exit and whose modules are
  -- unloaded by then, so no suppression can name them: leaks are checked by
  -- every other spec, not in MPI worlds)
  local args = {"--oversubscribe", "--allow-run-as-root", "-np", tostring(n), "-x", "ASAN_OPTIONS=detect_leaks=0"}
  for _, kv in ipairs(opts.pass or {}) do args[#args + 1] = "-x"; args[#args + 1] = kv end
  args[#args + 1] = S.bin
  args[#args + 1] = path
  return S.run(args, {bin = MPIRUN, timeout = opts.timeout or 90, env = opts.env})
end

local function count_oks(out) return select(2, ("\n" .. out):gsub("\nok ", "")) end

local function assert_clean(r, min_oks)
  assert.are.equal(0, r.status, r.out .. r.err)
  S.assert_checks(r)
  assert.is_true(count_oks(r.out) >= min_oks, ("only %d ok lines:\n%s\n%s"):format(count_oks(r.out), r.out, r.err))
end

local every = require "spec.collective_cases"

-- (a world of 3 whose rank is `me`, with rpc and a process group: a call to the
-- next rank and an all_reduce beside it; 2 checks)
local RPC_AND_ALL_REDUCE = [[
      local v = rpc.rpc_sync("w" .. ((me + 1) % n), function(a) return a * 10 end, {me})
      check("rpc_sync to the next rank", v == me * 10, v)
      local t = tensor.ones(2)
      dist.all_reduce(t)
      check("all_reduce beside rpc", at(t, 1) == 3, t)
]]

describe("the mpi backend #world", function()
  it("is installed here (scripts/setup.sh installs openmpi-bin and libopenmpi-dev)", function()
    local f = io.open(MPIRUN, "r")
    assert.is_truthy(f, "no " .. MPIRUN .. ": run scripts/setup.sh (it installs openmpi-bin and libopenmpi-dev)")
    f:close()
    assert.is_true(core.mpi_available(), select(2, core.mpi_available()))
  end)

  for _, n in ipairs({2, 4}) do
    it(("runs every collective on every dtype exactly, %d ranks"):format(n), function()
      local r = mpi_world(n, [[
        dist.init_process_group{backend = "mpi"}
        local rank, world_size = dist.get_rank(), dist.get_world_size()
        check("backend", dist.get_backend() == "mpi")
        check("rank from MPI", rank == tonumber(os.getenv("OMPI_COMM_WORLD_RANK")) and world_size == ]] .. n .. [[)
      ]] .. every .. [[
        dist.barrier()
        print("ok barrier")
        dist.destroy_process_group()
      ]])
      -- 6 dtypes x 3 sizes x (4 or 5 all_reduces + 6 others) per rank
      assert_clean(r, n * (6 * 3 * 10 + 2 * 3 + 2))
    end)
  end

  it("runs async Works, subgroups, send/recv and strided tensors on 3 ranks", function()
    local r = mpi_world(3, [[
      dist.init_process_group{backend = "mpi"}
      local me = dist.get_rank()
      local t = tensor.ones(5) * (me + 1)
      local w = dist.all_reduce(t, {async_op = true})
      w:wait()
      check("async all_reduce", w:is_completed() and at(t, 1) == 6 and at(t, 5) == 6, t)
      -- a strided (non-contiguous) tensor goes through a copy and is written back
      local m = tensor.ones(3, 4) * (me + 1)
      local col = m:t()
      dist.all_reduce(col)
      check("strided all_reduce", at(m, 2, 3) == 6 and at(col, 3, 2) == 6, m)
      local g = dist.new_group({0, 2})
      if me == 1 then
        check("non-member", g == dist.GroupMember.NON_GROUP_MEMBER or getmetatable(g) ~= nil)
      else
        local x = tensor.ones(2) * (me + 1)
        dist.all_reduce(x, {group = g})
        check("subgroup all_reduce", at(x, 1) == 4 and at(x, 2) == 4, x)
        check("subgroup rank", dist.get_rank(g) == (me == 0 and 0 or 1) and dist.get_world_size(g) == 2)
        local b = me == 2 and tensor.tensor({7, 8}) or tensor.zeros(2)
        dist.broadcast(b, 2, {group = g})
        check("subgroup broadcast from global rank 2", at(b, 1) == 7 and at(b, 2) == 8, b)
      end
      -- the world still works after a subgroup
      local y = tensor.ones(1)
      dist.all_reduce(y)
      check("world after subgroup", at(y, 1) == 3, y)
      if me == 0 then
        dist.send(tensor.arange(6):float(), 2)
        dist.send(tensor.ones(2) * 5, 2, {tag = 7})
      elseif me == 2 then
        local a, b = tensor.zeros(6), tensor.zeros(2)
        local src = dist.recv(a, 0)
        check("recv", src == 0 and at(a, 6) == 5 and at(a, 1) == 0, a)
        dist.recv(b, 0, {tag = 7})
        check("recv tagged", at(b, 1) == 5, b)
      end
      dist.barrier()
      check("barrier", true)
      dist.destroy_process_group()
    ]])
    assert_clean(r, 3 * 4 + 2 * 4)
  end)

  it("keeps async_op collectives and the ones after them in call order on every rank", function()
    local r = mpi_world(3, [[
      dist.init_process_group{backend = "mpi"}
      local me = dist.get_rank()
      local sched = require "rpchost.sched"
      local ok = true
      for round = 1, 5 do
        -- a large async all_reduce, a small sync one, an async broadcast, a barrier,
        -- with the ranks arriving at different times
        if me == round % 3 then sched.sleep(0.01) end
        local big = tensor.ones(262144) * (me + 1)
        local w1 = dist.all_reduce(big, {async_op = true})
        local small = tensor.ones(3) * (me + 10)
        dist.all_reduce(small)
        local b = me == 1 and tensor.ones(5) * round or tensor.zeros(5)
        local w2 = dist.broadcast(b, 1, {async_op = true})
        dist.barrier()
        w2:wait()
        w1:wait()
        ok = ok and at(big, 1) == 6 and at(big, 262144) == 6 and at(small, 2) == 33 and at(b, 5) == round
      end
      check("in order", ok)
      dist.destroy_process_group()
    ]])
    assert_clean(r, 3)
  end)

  it("lets rpc.init_rpc in the same processes meet at the store rank 0 sent through MPI", function()
    local r = mpi_world(3, [[
      dist.init_process_group{backend = "mpi"}
      local me, n = dist.get_rank(), dist.get_world_size()
      check("address exported", os.getenv("MASTER_ADDR") == "127.0.0.1" and tonumber(os.getenv("MASTER_PORT")))
      rpc.init_rpc("w" .. me)
    ]] .. RPC_AND_ALL_REDUCE .. [[
      rpc.shutdown()
      dist.destroy_process_group()
    ]])
    assert_clean(r, 3 * 3)
  end)

  -- (docs/environment.md, docs/cli.md: ranks started by mpirun need nothing exported)
  it("starts an RPC world under mpirun with nothing exported: rank 0 sends the store's address through MPI",
    function()
    local r = mpi_world(3, [[
      local me, n = tonumber(os.getenv "OMPI_COMM_WORLD_RANK"), 3
      check("nothing exported before", os.getenv("MASTER_ADDR") == nil and os.getenv("MASTER_PORT") == nil)
      rpc.init_rpc("w" .. me)
      check("rank from mpirun", rpc.get_worker_info().id == me, rpc.get_worker_info().id)
      check("address exported for dist", os.getenv("MASTER_ADDR") == "127.0.0.1" and tonumber(os.getenv("MASTER_PORT")))
      -- a gloo group in the same processes meets at the same store
      dist.init_process_group{backend = "gloo"}
    ]] .. RPC_AND_ALL_REDUCE .. [[
      dist.destroy_process_group()
      rpc.shutdown()
    ]])
    assert_clean(r, 3 * 5)
  end)

  it("starts a gloo process group under mpirun with nothing exported", function()
    local r = mpi_world(2, [[
      dist.init_process_group{backend = "gloo"}
      check("rank from mpirun", dist.get_rank() == tonumber(os.getenv "OMPI_COMM_WORLD_RANK"), dist.get_rank())
      local t = tensor.ones(3) * (dist.get_rank() + 1)
      dist.all_reduce(t)
      check("all_reduce", at(t, 1) == 3, t)
      dist.destroy_process_group()
    ]])
    assert_clean(r, 2 * 2)
  end)

  it("names a mismatched collective on every rank, and the group goes on", function()
    local r = mpi_world(2, [[
      dist.init_process_group{backend = "mpi", timeout = 20}
      local me = dist.get_rank()
      local ok, e = pcall(function()
        if me == 0 then dist.all_reduce(tensor.ones(3)) else dist.broadcast(tensor.ones(3), 0) end
      end)
      e = tostring(e)
      check("mismatch raised", not ok and e:find("collective mismatch", 1, true), e)
      check("mismatch named", e:find("all_reduce(float32, 3 elements, SUM)", 1, true) and
        e:find("broadcast(float32, 3 elements, root 0)", 1, true), e)
      local ok2, e2 = pcall(dist.all_reduce, tensor.ones(me == 0 and 4 or 5))
      check("size mismatch named", not ok2 and tostring(e2):find("4 elements", 1, true) and
        tostring(e2):find("5 elements", 1, true), e2)
      local t = tensor.ones(2)
      dist.all_reduce(t)
      check("usable after", at(t, 1) == 2, t)
      dist.destroy_process_group()
    ]])
    assert_clean(r, 2 * 4)
  end)

  it("fails a collective that a rank never calls within the timeout, naming it", function()
    local t0 = S.now()
    local r = mpi_world(2, [[
      dist.init_process_group{backend = "mpi", timeout = 2}
      local me = dist.get_rank()
      if me == 0 then
        local t0 = require("rpchost.core").now()
        local ok, e = pcall(dist.all_reduce, tensor.ones(3))
        local dt = require("rpchost.core").now() - t0
        check("timed out", not ok and tostring(e):find("did not complete within 2 s", 1, true), e)
        check("bounded", dt >= 1.9 and dt < 6, dt)
        local ok2, e2 = pcall(dist.all_reduce, tensor.ones(3))
        check("group stopped", not ok2 and e2.kind == "timeout" and tostring(e2):find("earlier failure", 1, true), e2)
      else
        require("rpchost.sched").sleep(4)
      end
    ]])
    assert.is_true(S.now() - t0 < 40, "the world took too long")
    S.assert_checks(r)
    assert.are.equal(3, count_oks(r.out), r.out .. r.err)
  end)

  -- (issue 32) the c10d functions on the mpi backend
  local prelude_32 = [[
    dist.init_process_group{backend = "mpi", timeout = 20}
    local me, n = dist.get_rank(), dist.get_world_size()
    local R = dist.ReduceOp
    local function same(t, want)
      local got = t:contiguous():view(-1):totable()
      if #got ~= #want then return false end
      for i = 1, #want do
        if type(want[i]) == "number" then
          if math.abs(got[i] - want[i]) > 1e-6 * math.max(1, math.abs(want[i])) then return false end
        elseif got[i] ~= want[i] then return false end
      end
      return true
    end
  ]]

  it("reduces with BAND, BOR and BXOR on int32, int64, uint8 and bool, and refuses floats on every rank", function()
    local r = mpi_world(3, prelude_32 .. [[
      local bit = require "bit"
      local F = {BAND = bit.band, BOR = bit.bor, BXOR = bit.bxor}
      local L = {BAND = function(a, b) return a and b end, BOR = function(a, b) return a or b end,
                 BXOR = function(a, b) return a ~= b end}
      -- element 1 negative (all high bits set), element 2 with bit 40 set for int64:
      -- with 3 ranks both survive all three ops, so the 32-bit bit library checks them
      local function base(r, i, dt)
        if dt == "bool" then return (r + i) % 2 == 0 or i % 3 == 0 end
        if i == 1 and dt ~= "uint8" then return -1 - r end
        return bit.band(0x5A + 37 * r + 11 * i, 0xFF)
      end
      local function high(i, dt) return (dt == "int64" and i == 2) and 2 ^ 40 or 0 end
      local function value(r, i, dt)
        if dt == "bool" then return base(r, i, dt) end
        return base(r, i, dt) + high(i, dt)
      end
      local function input(r, dt, k)
        local v = {}
        for i = 1, k do v[i] = value(r, i, dt) end
        return tensor.tensor(v, {dtype = tensor[dt]})
      end
      local function expected(op, dt, k)
        local out = {}
        for i = 1, k do
          local acc = base(0, i, dt)
          for q = 1, n - 1 do acc = (dt == "bool" and L or F)[op](acc, base(q, i, dt)) end
          if dt ~= "bool" then acc = acc + high(i, dt) end
          out[i] = acc
        end
        return out
      end
      check("3 ranks", n == 3)
      for _, dt in ipairs({"int32", "int64", "uint8", "bool"}) do
        for _, op in ipairs({"BAND", "BOR", "BXOR"}) do
          local t = input(me, dt, 6)
          dist.all_reduce(t, R[op])
          check("all_reduce " .. op .. " " .. dt, same(t, expected(op, dt, 6)), t)
        end
        local t = input(me, dt, 6)
        dist.reduce(t, 2, R.BXOR)
        check("reduce BXOR " .. dt, me ~= 2 or same(t, expected("BXOR", dt, 6)), t)
        -- rank q gets block q (2 elements) of the reduction
        local want = expected("BOR", dt, 6)
        local out = tensor.zeros(2, {dtype = tensor[dt]})
        dist.reduce_scatter_tensor(out, input(me, dt, 6), R.BOR)
        check("reduce_scatter_tensor BOR " .. dt, same(out, {want[2 * me + 1], want[2 * me + 2]}), out)
        local list = {}
        local full = input(me, dt, 6)
        for q = 1, 3 do list[q] = full:narrow(1, 2 * q - 1, 2):clone() end
        local out2 = tensor.zeros(2, {dtype = tensor[dt]})
        dist.reduce_scatter(out2, list, R.BAND)
        want = expected("BAND", dt, 6)
        check("reduce_scatter BAND " .. dt, same(out2, {want[2 * me + 1], want[2 * me + 2]}), out2)
      end
      for _, dt in ipairs({"float32", "float64"}) do
        local ok, e = pcall(dist.all_reduce, tensor.ones(3, {dtype = tensor[dt]}), R.BAND)
        check("BAND refused on " .. dt, not ok and e.kind == "config" and
          tostring(e):find("Cannot use ReduceOp.BAND with non-integral dtype " .. dt, 1, true), e)
        ok, e = pcall(dist.reduce_scatter_tensor, tensor.zeros(1, {dtype = tensor[dt]}),
          tensor.zeros(3, {dtype = tensor[dt]}), R.BXOR)
        check("BXOR refused on " .. dt, not ok and tostring(e):find("ReduceOp.BXOR with non-integral", 1, true), e)
      end
      local t = tensor.tensor({6, 3}, {dtype = tensor.int32})
      dist.all_reduce(t, R.BAND)
      check("usable after", same(t, {6, 3}), t)
      dist.destroy_process_group()
    ]])
    assert_clean(r, 3 * (1 + 4 * 6 + 4 + 1))
  end)

  it("gathers into one flat, stacked or strided tensor and reduce-scatters from one (SUM, AVG), 3 ranks", function()
    local r = mpi_world(3, prelude_32 .. [[
      local k = 4
      local function piece(q) return tensor.arange(k):float() + q * 10 end
      local want = {}
      for q = 0, n - 1 do for i = 0, k - 1 do want[#want + 1] = q * 10 + i end end
      local flat = tensor.zeros(n * k)
      dist.all_gather_into_tensor(flat, piece(me))
      check("all_gather_into_tensor flat [n*k]", same(flat, want), flat)
      local stacked = tensor.zeros(n, k, {dtype = tensor.int64})
      dist._all_gather_base(stacked, piece(me):long())
      check("_all_gather_base stacked [n, k]", same(stacked, want) and stacked:size(1) == n, stacked)
      local strided = tensor.zeros(k, n):t() -- [n, k], not contiguous
      dist.all_gather_into_tensor(strided, piece(me))
      check("all_gather_into_tensor strided", same(strided, want), strided)
      -- a rank whose input (and so output) has another size is named on every rank
      local kk = me == 1 and 5 or 4
      local ok, e = pcall(dist.all_gather_into_tensor, tensor.zeros(n * kk), tensor.zeros(kk))
      check("other size named", not ok and tostring(e):find("collective mismatch", 1, true) and
        tostring(e):find("all_gather_into_tensor(float32, 5 elements, into float32[15])", 1, true) and
        tostring(e):find("all_gather_into_tensor(float32, 4 elements, into float32[12])", 1, true), e)
      -- reduce_scatter_tensor: rank q gets the reduction of block q of every rank's input
      local function input(q, dt)
        local v = {}
        for i = 0, n * k - 1 do v[#v + 1] = (q + 1) * (i + 1) end
        return tensor.tensor(v, {dtype = tensor[dt]})
      end
      local function block(scale)
        local v = {}
        for i = me * k, me * k + k - 1 do v[#v + 1] = scale * (i + 1) end
        return v
      end
      local out = tensor.zeros(k, {dtype = tensor.int32})
      dist.reduce_scatter_tensor(out, input(me, "int32"), R.SUM)
      check("reduce_scatter_tensor SUM", same(out, block(1 + 2 + 3)), out)
      local avg = tensor.zeros(k)
      dist._reduce_scatter_base(avg, input(me, "float32"), R.AVG)
      check("_reduce_scatter_base AVG", same(avg, block(2)), avg)
      local rs = tensor.zeros(k, 2) -- (its first column, strided, is the output)
      dist.reduce_scatter_tensor(rs:select(2, 1), input(me, "float64"):float(), R.MAX)
      check("reduce_scatter_tensor strided MAX", same(rs:select(2, 1), block(3)) and same(rs:select(2, 2), {0, 0, 0, 0}),
        rs)
      local ok2, e2 = pcall(dist.reduce_scatter_tensor, tensor.zeros(k, {dtype = tensor.int32}),
        input(me, "int32"), R.AVG)
      check("AVG refused on int32", not ok2 and tostring(e2):find("AVG needs a floating point tensor", 1, true), e2)
      dist.destroy_process_group()
    ]])
    assert_clean(r, 3 * 8)
  end)

  it("runs all_to_all_single with even and uneven splits, and names a mismatched split on every rank", function()
    local r = mpi_world(3, prelude_32 .. [[
      -- even (no splits): 2 rows of 2 to each rank
      local out = tensor.zeros(2 * n, 2)
      dist.all_to_all_single(out, (tensor.arange(4 * n):float() + me * 100):view(2 * n, 2))
      local want = {}
      for q = 0, n - 1 do for i = 4 * me, 4 * me + 3 do want[#want + 1] = q * 100 + i end end
      check("even splits", same(out, want), out)
      -- uneven: rank q sends j + 1 rows (valued 10q + j) to rank j; each rank gets me + 1 from each
      local vals, ins, outs = {}, {}, {}
      for j = 0, n - 1 do
        ins[j + 1], outs[j + 1] = j + 1, me + 1
        for _ = 1, j + 1 do vals[#vals + 1] = 10 * me + j end
      end
      local o = tensor.zeros(n * (me + 1), {dtype = tensor.int64})
      dist.all_to_all_single(o, tensor.tensor(vals, {dtype = tensor.int64}), outs, ins)
      want = {}
      for q = 0, n - 1 do for _ = 1, me + 1 do want[#want + 1] = 10 * q + me end end
      check("uneven splits", same(o, want), o)
      -- a strided output, and an empty segment (rank 0 sends nothing to rank 2)
      local z_in = me == 0 and {3, 1, 0} or {3, 1, 1}
      local z_out = me == 0 and {3, 3, 3} or me == 1 and {1, 1, 1} or {0, 1, 1}
      local total = 0
      for _, c in ipairs(z_out) do total = total + c end
      local so = tensor.zeros(total, 2):select(2, 1)
      local src = tensor.ones(3 + 1 + (me == 0 and 0 or 1)) * (me + 1)
      dist.all_to_all_single(so, src, z_out, z_in)
      want = {}
      for q = 0, n - 1 do for _ = 1, z_out[q + 1] do want[#want + 1] = q + 1 end end
      check("strided output, empty segment", same(so, want), so)
      -- rank 1 sends 3 rows to rank 0, which expects 2
      local bad_in = me == 1 and {3, 1, 2} or {2, 2, 2}
      local ok, e = pcall(dist.all_to_all_single, tensor.zeros(6), tensor.zeros(6), {2, 2, 2}, bad_in)
      check("mismatched split named", not ok and e.kind == "config" and tostring(e):find(
        "rank 1 sends 3 elements to rank 0, but rank 0 expects 2 from it", 1, true) and
        tostring(e):find("rank 1's input_split_sizes[1], rank 0's output_split_sizes[2]", 1, true), e)
      -- every rank splits evenly, but rank 2 by another count
      local c = me == 2 and 3 or 2
      ok, e = pcall(dist.all_to_all_single, tensor.zeros(3 * c), tensor.zeros(3 * c))
      check("mismatched even split named", not ok and tostring(e):find("rank 2 sends 3 elements to rank 0, but rank 0 expects 2", 1, true), e)
      local t = tensor.ones(2)
      dist.all_reduce(t)
      check("usable after", same(t, {3, 3}), t)
      dist.destroy_process_group()
    ]])
    assert_clean(r, 3 * 6)
  end)

  it("runs all_to_all with a different size and shape for every pair, 4 ranks", function()
    local r = mpi_world(4, prelude_32 .. [[
      -- rank q sends rank j a [q + 1, j + 1] tensor of 100q + 10j + index
      local function block(q, j)
        local v = {}
        for i = 0, (q + 1) * (j + 1) - 1 do v[#v + 1] = 100 * q + 10 * j + i end
        return v
      end
      local ins, outs = {}, {}
      for j = 0, n - 1 do
        ins[j + 1] = tensor.tensor(block(me, j), {dtype = tensor.int32}):view(me + 1, j + 1)
        outs[j + 1] = tensor.zeros(j + 1, me + 1, {dtype = tensor.int32})
      end
      outs[n] = tensor.zeros(me + 1, n, {dtype = tensor.int32}):t() -- (strided: [n, me + 1])
      dist.all_to_all(outs, ins)
      local ok = true
      for q = 0, n - 1 do ok = ok and same(outs[q + 1], block(q, me)) end
      check("all_to_all per-pair sizes", ok, outs[2])
      local e1, e2 = {}, {}
      for j = 1, n do e1[j], e2[j] = tensor.zeros(0), tensor.zeros(0) end
      dist.all_to_all(e1, e2)
      check("all empty", true)
      -- rank 3 expects one element too many from rank 0
      local o2, i2 = {}, {}
      for j = 1, n do o2[j], i2[j] = tensor.zeros(2), tensor.ones(2) end
      if me == 3 then o2[1] = tensor.zeros(3) end
      local okm, e = pcall(dist.all_to_all, o2, i2)
      check("mismatch named", not okm and tostring(e):find(
        "rank 0 sends 2 elements to rank 3, but rank 3 expects 3 from it", 1, true), e)
      dist.destroy_process_group()
    ]])
    assert_clean(r, 4 * 3)
  end)

  it("receives from any rank and says who sent, in posting order, in the world and a subgroup, 3 ranks", function()
    local r = mpi_world(3, prelude_32 .. [[
      if me == 0 then
        local got = {}
        for _ = 1, 2 do
          local t = tensor.zeros(2)
          local from = dist.recv(t, {tag = 5})
          got[from] = t:totable()[1]
        end
        check("both senders", got[1] == 10 and got[2] == 20, got[1] .. " " .. tostring(got[2]))
        local ok, e = pcall(dist.recv, tensor.zeros(2), {tag = 6})
        check("too big named", not ok and e.kind == "config" and
          tostring(e):find("recv from any rank: rank 2 sent more than this tensor's 8 bytes", 1, true), e)
        ok, e = pcall(dist.recv, tensor.zeros(2), nil, {tag = 7})
        check("too small named", not ok and tostring(e):find("rank 1 sent 4 bytes but this tensor holds 8", 1, true), e)
      else
        dist.send(tensor.ones(2) * (10 * me), 0, {tag = 5})
        if me == 2 then dist.send(tensor.ones(3), 0, {tag = 6}) else dist.send(tensor.ones(1), 0, {tag = 7}) end
      end
      dist.barrier()
      -- an irecv takes its place when made: a receive made later but waited on first
      -- gets the second message
      if me == 0 then
        local a, b = tensor.zeros(1), tensor.zeros(1)
        local w = dist.irecv(a, 1, {tag = 3})
        local from = dist.recv(b, {tag = 3})
        w:wait()
        check("posting order", from == 1 and w:source_rank() == 1 and a:item() == 1 and b:item() == 2,
          a:item() .. " " .. b:item())
      elseif me == 1 then
        dist.send(tensor.ones(1), 0, {tag = 3})
        dist.send(tensor.ones(1) * 2, 0, {tag = 3})
      end
      -- in a subgroup of global ranks 0 and 2 the sender is named by its global rank
      local sub = dist.new_group({0, 2})
      if me == 0 then
        local t = tensor.zeros(1)
        local from = dist.recv(t, {group = sub})
        check("subgroup sender is global rank 2", from == 2 and t:item() == 7, from)
      elseif me == 2 then
        dist.send(tensor.ones(1) * 7, 0, {group = sub})
      end
      dist.barrier()
      check("done", true)
      dist.destroy_process_group()
    ]])
    assert_clean(r, 5 + 3)
  end)

  it("refuses rank/world_size that disagree with MPI", function()
    local r = mpi_world(2, [[
      local ok, e = pcall(dist.init_process_group, {backend = "mpi", world_size = 5})
      check("refused", not ok and tostring(e):find("world_size = 5 was given but MPI says", 1, true), e)
      require("rpchost.core").mpi_finalize()
    ]])
    assert_clean(r, 2)
  end)

  it("refuses ranks started without mpirun (each would be a world of one)", function()
    local r = S.world(2, [[
      local dist = require "dist"
      local ok, e = pcall(dist.init_process_group, {backend = "mpi"})
      print(ok, e)
      require("rpchost.core").mpi_finalize()
    ]])
    assert.is_truthy(r.out:find("start the ranks with mpirun", 1, true), r.out .. r.err)
    assert.is_nil(r.out:find("true", 1, true), r.out)
  end)

  it("names what is wrong when the library is missing or is not Open MPI", function()
    local script = S.write([[
      local dist = require "dist"
      local ok, e = pcall(dist.init_process_group, {backend = "mpi"})
      print(ok, e)
    ]])
    local r = S.run({script}, {env = {RPCHOST_MPI_LIB = "/nonexistent/libmpi.so"}})
    assert.is_truthy(r.out:find("cannot load $RPCHOST_MPI_LIB (/nonexistent/libmpi.so)", 1, true), r.out .. r.err)
    assert.is_truthy(r.out:find("openmpi-bin and libopenmpi-dev", 1, true), r.out .. r.err)
    r = S.run({script}, {env = {RPCHOST_MPI_LIB = "libm.so.6"}})
    assert.is_truthy(r.out:find("is not Open MPI", 1, true), r.out .. r.err)
  end)
end)
