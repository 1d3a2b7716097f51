-- The "mpi" process-group backend over real `mpirun` worlds of 2-4 ranks
-- (Open MPI, as scripts/setup.sh installs it): every collective x dtype against
-- exact values, async Works, subgroups, point to point, rpc.init_rpc in the same
-- processes with the store's address sent through MPI, a mismatched collective
-- named on every rank, a rank that never calls bounded by the timeout, and the
-- errors for a library that is missing or not Open MPI.
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
      local v = rpc.rpc_sync("w" .. ((me + 1) % n), function(a) return a * 10 end, {me})
      check("rpc_sync to the next rank", v == me * 10, v)
      local t = tensor.ones(2)
      dist.all_reduce(t)
      check("all_reduce beside rpc", at(t, 1) == 3, t)
      rpc.shutdown()
      dist.destroy_process_group()
    ]])
    assert_clean(r, 3 * 3)
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
