-- bench/soak.lua: the soak of issue 37. Runs each long-lived workload rpchost
-- offers at full rate for a while, one after another, in a world of three ranks
-- (w0 drives, w1 and w2 serve or take part), and says whether memory, descriptors,
-- the runtime's bookkeeping and speed stay flat.
--
-- Why: training jobs, parameter servers and RL worlds run for days. A few bytes
-- kept per call, per RRef or per context are invisible in a test and fatal in a
-- week; so is a table whose cost grows with what came before. This measures each
-- workload on its own, so that growth is pinned on the workload that makes it.
--
-- Each workload runs SECONDS: a warm-up (the first tenth, or warm=F of the run:
-- JIT, pools and tables reach their working size), checkpoint A, the rest, the last
-- tenth, checkpoint B. At a checkpoint every rank collects garbage in full twice
-- (its RRefs' releases go out, the owners' come back: w0 repeats it until every
-- rank's rpc.debug_info() stands still), flushes LuaJIT's compiled traces (GC
-- objects that come and go, bounded by LuaJIT), and reports its Lua heap, RSS once
-- malloc has given back the pages it kept free (malloc_trim; RSS before that is
-- printed beside it), open descriptors (/proc/self/fd), tensor bytes and
-- rpc.debug_info(); w1 and w2 report through an RPC w0 makes (soak_measure), or, in
-- the workloads where every rank runs the same steps (collectives, DDP), in the
-- reply to the call that ran them. Growth per operation is (B - A) over the
-- operations between A and B; speed is the operations per second of the last tenth
-- against the first tenth's. Every reply's value is checked: a call that fails when
-- it should not is "lost", a wrong value "wrong". Where a rank's heap grew, a
-- census of its Lua heap (objects by the path they are reached by) after B and
-- again after one more tenth of the workload names what grew.
--
-- The workloads (one operation of each):
--   tensor_calls    rpc_sync to w1 / w2 with a 256-float tensor, the reply checked
--   rref            remote() a ~600-byte table on w1, fork it to w2 (which reads
--                   it), an RRef on w2 that holds it (an RRef inside an RRef),
--                   forked back to its owner w1, which reads both; all dropped
--   remote_module   RemoteModule forward on w1 / w2 (nn.Linear 16 -> 8)
--   dist_optimizer  a dist_autograd context: two RemoteModules (w1, w2) forward,
--                   backward, DistributedOptimizer step (SGD, momentum; lr 0 keeps
--                   the weights, so every gradient can be checked), get_gradients
--   dist_autograd   a context: forward to w1, which calls w2 (two hops; or w2
--                   then w1), backward, get_gradients checked
--   pipe            a training step of an nn.Pipe whose two stages live on w1
--                   and w2 (4 micro-batches), GPipe or 1F1B in turn, in a
--                   dist_autograd context, with a DistributedOptimizer step; the
--                   loss checked (lr 0 keeps it)
--   ddp             a DistributedDataParallel step on every rank (forward,
--                   backward with its bucketed all_reduce, optimizer step), the
--                   averaged gradients checked
--   collectives     all_reduce, broadcast, all_gather_into_tensor, all_to_all_single and barrier on
--                   the world, then on the subgroup {w0, w1} (w2 is outside it)
--   remote_errors   a call that raises on w1 / w2; the error checked
--   timeouts        a call with a 10 ms timeout to a function that takes 30 ms
--                   (its reply comes late and is dropped) and a normal call,
--                   alternately; every timeout and every answer checked
--   members         a process that joins as a dynamic member (init_rpc without a
--                   world size), calls w0, w1 and w2, holds an RRef, and leaves
--
-- usage: rpchost run --nproc-per-node 3 bench/soak.lua SECONDS [WORKLOADS] [strict] [warm=F]
--        rpchost bench/soak.lua --list       (the workloads' names)
--   (bench/soak.sh is the command). WORKLOADS: a comma-separated list, or "all";
--   warm=F: checkpoint A after that share of the run (0.1 to 0.8; default 0.1).
-- Output (w0): a table per workload as it ends, then the targets beside the
-- measured numbers with PASS / MISS, and lines for programs:
--   SOAK w=<workload> rank=<r> ops=<n> heap=<bytes> rss=<bytes> fds=<A>:<B> tensor=<bytes>
--        first=<ops/s> last=<ops/s> lost=<n> wrong=<n> debug=<counts not back, or ->
--   SOAK_RESULT PASS | MISS
-- Exit status: 0; 1 when a call was lost or answered wrongly (or, with "strict",
-- when a target is missed).
local rpc = require "rpc"
local dist = require "dist"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local dist_autograd = require "dist_autograd"
local sched = require "rpchost.sched"
local core = require "rpchost.core"

local now = sched.now
local rank = tonumber(os.getenv "RANK")
local PAGE = 4096

-- the functions the workloads call on w1 and w2 (globals: they travel by name) --------
PAD = ("x"):rep(560)
function soak_echo(i) return i end
function soak_double(t) return t * 2 end
function soak_box(i) return {n = i, pad = PAD} end
function soak_box_n(r) return r:to_here().n end
function soak_wrap(r, i) return {inner = r, i = i} end
function soak_outer_n(outer)
  local v = outer:to_here()
  return v.inner:to_here().n + v.i
end
function soak_raise(i) error("soak error <" .. i .. ">") end
SLOW, SHORT = 0.03, 0.01
function soak_slow(i)
  rpc.sleep(SLOW)
  return i
end
function soak_mul3(x) return x * 3 end
function soak_mul3_then(x, to) return rpc.rpc_sync(to, soak_mul3, {x * 3}) end
function soak_linear_params(mref)
  local m = mref:local_value()
  return m.weight:detach():clone(), m.bias:detach():clone()
end

-- a dynamic member: this same file, started by w0 without RANK or WORLD_SIZE ---------
if os.getenv("SOAK_MEMBER") then
  local i = tonumber(os.getenv("SOAK_I"))
  rpc.init_rpc(os.getenv("SOAK_MEMBER"))
  local ok = rpc.rpc_sync("w0", soak_echo, {i}) == i and rpc.rpc_sync("w1", soak_echo, {i + 1}) == i + 1
    and rpc.rpc_sync("w2", soak_echo, {i + 2}) == i + 2
  local r = rpc.remote(i % 2 == 0 and "w1" or "w2", soak_box, {i}) -- held until it leaves
  ok = ok and r:to_here().n == i
  r = nil
  collectgarbage()
  rpc.shutdown()
  if not ok then
    io.stderr:write("soak member ", i, ": a reply was wrong\n")
    os.exit(3)
  end
  return
end

-- measuring a rank -------------------------------------------------------------------------
-- resident bytes: in all (statm), and anonymous, file-backed and shared memory
-- (/proc/self/status), which say where growth is: malloc and the Lua heap,
-- mapped files, shared-memory rings and segments
local function rss()
  local f = io.open("/proc/self/statm")
  local pages = f and tonumber(f:read("*a"):match("^%d+%s+(%d+)")) or 0
  if f then f:close() end
  local kinds = {}
  f = io.open("/proc/self/status")
  local text = f and f:read("*a") or ""
  if f then f:close() end
  for _, k in ipairs({"Anon", "File", "Shmem"}) do
    kinds[k] = (tonumber(text:match("Rss" .. k .. ":%s*(%d+)")) or 0) * 1024
  end
  return pages * PAGE, kinds
end

-- the open descriptors, in all, by kind (socket, pipe, anon_inode's eventfd or
-- eventpoll, /dev/shm, file) and by number (fd -> what it is), read from
-- /proc/self/fd in this process (a child, as io.popen's ls, would add its pipe
-- for a moment). The directory's own descriptor is counted at every checkpoint alike.
local ffi = require "ffi"
ffi.cdef [[
typedef struct DIR DIR;
struct soak_dirent { uint64_t d_ino; int64_t d_off; unsigned short d_reclen; unsigned char d_type; char d_name[256]; };
DIR *opendir(const char *name);
struct soak_dirent *readdir(DIR *d);
int closedir(DIR *d);
long readlink(const char *path, char *buf, size_t size);
int malloc_trim(size_t pad);
]]
local function fds()
  local n, kinds, list = 0, {}, {}
  local dir = ffi.C.opendir("/proc/self/fd")
  if dir == nil then return 0, kinds, list end
  local buf = ffi.new("char[?]", 4096)
  while true do
    local e = ffi.C.readdir(dir)
    if e == nil then break end
    local fd = ffi.string(e.d_name)
    if fd:match("^%d+$") then
      local len = ffi.C.readlink("/proc/self/fd/" .. fd, buf, 4096)
      local target = len > 0 and ffi.string(buf, len) or "?"
      n = n + 1
      list[fd] = target
      local kind = target:match("^(%a+):%[") or target:match("^anon_inode:(.*)$") or target:match("^(/dev/shm)/")
        or "file"
      kinds[kind] = (kinds[kind] or 0) + 1
    end
  end
  ffi.C.closedir(dir)
  return n, kinds, list
end

local function debug_info()
  local ok, d = pcall(rpc.debug_info) -- (absent before issue 37: the rest is measured all the same)
  return ok and d or {}
end

-- a full collection, twice: finalizers (an RRef's release) run in the first and
-- what they freed goes in the second; the RRef releases they queue go out now.
-- Compiled traces are flushed first, as soak_measure does: a trace can keep
-- objects it was compiled against alive (an RRef of the workload before), and
-- then the first checkpoint's flush frees them and reads their releases in
-- flight as the next workload's. (Once in CI ddp's A had pipe's owner RRefs,
-- 4 at A and 0 at B, and 2 more pending requests on w0, after the quiesce.)
function soak_gc()
  jit.flush()
  collectgarbage()
  collectgarbage()
  return debug_info()
end

-- RSS is read twice: as it stands (kept: malloc keeps the pages it freed, up to
-- 512 MiB, for reuse, RPCHOST_MALLOC_TUNE), and once malloc_trim has given the
-- free ones back (what the targets use): a collection frees the garbage of
-- thousands of small tensors at once, and where those pages sat, below a live
-- block or above, decides whether a checkpoint sees them, so B could be above A
-- by the peak garbage of a cycle that came after A, with nothing more live.
-- What stays live is counted either way.
function soak_measure()
  jit.flush()
  collectgarbage()
  collectgarbage()
  local heap = collectgarbage("count") * 1024
  local kept = rss()
  ffi.C.malloc_trim(0)
  local resident, parts = rss()
  local n, kinds, list = fds()
  return {heap = heap, rss = resident, rss_kept = kept, rss_parts = parts, fds = n, fd_kinds = kinds,
          fd_list = list, tensor = tensor.live_bytes(), debug = debug_info()}
end

-- A's heap once its records are kept (they are in the heap at B): the rank
-- that keeps them counts them in its baseline, not in the workload's growth
local function rebase(m)
  collectgarbage()
  collectgarbage()
  m.heap = collectgarbage("count") * 1024
end

-- The census: every table reachable from the loaded modules, the globals, the
-- registry, functions' upvalues, metatables and suspended tasks' locals (and the
-- functions, userdata and tasks met on the way), summed by the path each is
-- first reached by (numbers in keys and digits in names folded, so a record per
-- call or per peer adds up under one path): path -> {objects, table entries}.
-- Taken after B (its own garbage must disturb no measurement), kept in a file
-- (not in the heap it counts), and again after one more tenth of the workload.
local function census()
  local seen, acc = {}, {}
  local qo, qp, head, tail = {}, {}, 1, 0
  seen[seen], seen[acc], seen[qo], seen[qp] = true, true, true, true
  seen[coroutine.running() or seen] = true
  local function push(o, p)
    if not seen[o] then
      seen[o] = true
      tail = tail + 1
      qo[tail], qp[tail] = o, p
    end
  end
  local function keyname(k)
    local tk = type(k)
    if tk == "string" then
      if #k <= 48 and k:match("^[%w_.:/%-]+$") then
        k = k:gsub("%d+", "#")
        return k:match("^[%a_][%w_#]*$") and ("." .. k) or ("[" .. k .. "]")
      end
      return "[str]"
    end
    return tk == "number" and "[n]" or ("[" .. tk .. "]")
  end
  local function count(p, n)
    local a = acc[p]
    if not a then a = {0, 0}; acc[p] = a end
    a[1], a[2] = a[1] + 1, a[2] + n
  end
  local function ref(v)
    local t = type(v)
    return t == "table" or t == "function" or t == "thread" or t == "userdata" or t == "cdata"
  end
  push(package.loaded, "loaded")
  push(_G, "_G")
  push(debug.getregistry(), "reg")
  while head <= tail do
    local o, p = qo[head], qp[head]
    qo[head], qp[head] = nil, nil
    head = head + 1
    local t = type(o)
    if t == "table" then
      local n = 0
      for k, v in next, o do
        n = n + 1
        if ref(v) then push(v, p .. keyname(k)) end
        if ref(k) then push(k, p .. "{" .. type(k) .. "}") end
      end
      count(p, n)
      local mt = debug.getmetatable(o)
      if mt then push(mt, p .. "<mt>") end
    elseif t == "function" then
      count(p, 0)
      for i = 1, 255 do
        local name, v = debug.getupvalue(o, i)
        if not name then break end
        if ref(v) then push(v, p .. "^" .. name) end
      end
    elseif t == "cdata" then
      count(p, 0)
    elseif t == "userdata" then
      count(p, 0)
      local mt = debug.getmetatable(o)
      if mt then push(mt, p .. "<mt>") end
      local env = debug.getfenv(o)
      if ref(env) then push(env, p .. "<env>") end
    elseif t == "thread" then
      count(p, 0)
      for level = 0, 60 do
        local info = debug.getinfo(o, level, "f")
        if not info then break end
        push(info.func, p .. "@" .. level)
        for i = 1, 250 do
          local name, v = debug.getlocal(o, level, i)
          if not name then break end
          if ref(v) then push(v, p .. "@" .. level .. "." .. name) end
        end
      end
    end
  end
  return acc
end

local function census_file()
  return ("%s/rpchost-soak-census-%d.txt"):format(os.getenv("TMPDIR") or "/tmp", core.getpid())
end

function soak_census_first()
  local f = assert(io.open(census_file(), "w"))
  for p, a in pairs(census()) do f:write(a[1], "\t", a[2], "\t", p, "\n") end
  f:close()
  return true
end

-- the paths whose tables or entries grew most since soak_census_first: a list
-- of "path +objects/+entries (now objects/entries)"
function soak_census_then()
  local b = census()
  local f = io.open(census_file())
  if not f then return {} end
  local grew = {}
  for line in f:lines() do
    local nt, ne, p = line:match("^(%d+)\t(%d+)\t(.*)$")
    local x = b[p]
    if x then
      b[p] = nil
      if x[1] + x[2] > tonumber(nt) + tonumber(ne) then
        grew[#grew + 1] = {p, x[1] - tonumber(nt), x[2] - tonumber(ne), x[1], x[2]}
      end
    end
  end
  f:close()
  os.remove(census_file())
  for p, x in pairs(b) do grew[#grew + 1] = {p, x[1], x[2], x[1], x[2]} end
  table.sort(grew, function(u, v) return u[2] + u[3] > v[2] + v[3] end)
  local out = {}
  for i = 1, math.min(8, #grew) do
    local g = grew[i]
    out[i] = ("%s +%d objects/+%d entries (now %d/%d)"):format(g[1], g[2], g[3], g[4], g[5])
  end
  return out
end

-- the workloads -----------------------------------------------------------------------------
-- kind "calls": w0 runs `tasks` tasks of step(state, i), each operation one step;
-- kind "spmd": every rank runs setup and step together (soak_spmd), w0 decides
-- when a stretch ends and says so in a broadcast before each step. settle: the
-- seconds to wait before a checkpoint (late replies still on their way).
local function expect(st, cond, what)
  if not cond then
    st.wrong = st.wrong + 1
    if #st.why < 3 then st.why[#st.why + 1] = "wrong: " .. tostring(what) end
  end
end

local function close(a, b, tol)
  return tensor.is_tensor(a) and tensor.is_tensor(b) and a:numel() == b:numel()
    and (a - b):abs():max():item() <= (tol or 1e-5)
end

local function peer(i) return i % 2 == 0 and "w1" or "w2" end

local W, ORDER = {}, {}
local function workload(name, def)
  W[name] = def
  ORDER[#ORDER + 1] = name
end

workload("tensor_calls", {kind = "calls", tasks = 4,
  setup = function() return {} end,
  step = function(st, i)
    local k = i % 1000
    local y = rpc.rpc_sync(peer(i), soak_double, {tensor.full({256}, k)})
    expect(st, y:numel() == 256 and y:min():item() == 2 * k and y:max():item() == 2 * k, "tensor reply")
  end})

workload("rref", {kind = "calls", tasks = 2,
  setup = function() return {} end,
  step = function(st, i)
    local r = rpc.remote("w1", soak_box, {i})                  -- owned by w1, held here
    expect(st, rpc.rpc_sync("w2", soak_box_n, {r}) == i, "w2 reading a forked RRef") -- a user's fork to w2
    local outer = rpc.remote("w2", soak_wrap, {r, i})          -- an RRef inside an RRef, owned by w2
    expect(st, rpc.rpc_sync("w1", soak_outer_n, {outer}) == 2 * i, "the owner reading its RRef inside another")
    r, outer = nil, nil
  end})

workload("remote_module", {kind = "calls", tasks = 2,
  setup = function()
    tensor.manual_seed(7)
    local st = {m = {}, x = {}, y = {}}
    for j, to in ipairs({"w1", "w2"}) do
      st.m[j] = rpc.RemoteModule(to .. "/cpu", nn.Linear, {16, 8})
      local w, b = rpc.rpc_sync(to, soak_linear_params, {st.m[j]:get_module_rref()})
      st.x[j] = tensor.randn(4, 16)
      st.y[j] = st.x[j]:matmul(w:t()) + b
    end
    return st
  end,
  step = function(st, i)
    local j = i % 2 + 1
    expect(st, close(st.m[j]:forward(st.x[j]), st.y[j]), "RemoteModule forward")
  end})

workload("dist_autograd", {kind = "calls", tasks = 2,
  setup = function() return {x = tensor.ones(4, {requires_grad = true})} end,
  step = function(st, i)
    dist_autograd.context(function(ctx)
      local y = rpc.rpc_sync(peer(i), soak_mul3_then, {st.x, peer(i + 1)}) -- w1 calls w2, or w2 w1
      dist_autograd.backward(ctx, {y:sum()})
      local g = dist_autograd.get_gradients(ctx)[st.x]
      expect(st, g and g:min():item() == 9 and g:max():item() == 9, "the gradient through two workers")
    end)
  end})

workload("dist_optimizer", {kind = "calls", tasks = 2,
  setup = function()
    tensor.manual_seed(8)
    local st = {}
    st.m1 = rpc.RemoteModule("w1", nn.Linear, {16, 8})
    st.m2 = rpc.RemoteModule("w2", nn.Linear, {8, 1})
    local ps = st.m1:remote_parameters()
    for _, p in ipairs(st.m2:remote_parameters()) do ps[#ps + 1] = p end
    st.opt = rpc.DistributedOptimizer(optim.SGD, ps, {lr = 0, momentum = 0.9})
    local w1, b1 = rpc.rpc_sync("w1", soak_linear_params, {st.m1:get_module_rref()})
    local w2, b2 = rpc.rpc_sync("w2", soak_linear_params, {st.m2:get_module_rref()})
    st.x = tensor.randn(4, 16, {requires_grad = true})
    local x = st.x:detach():clone()
    x.requires_grad = true;
    ((x:matmul(w1:t()) + b1):matmul(w2:t()) + b2):sum():backward()
    st.gx = x.grad
    return st
  end,
  step = function(st)
    dist_autograd.context(function(ctx)
      local y = st.m2(st.m1(st.x))
      dist_autograd.backward(ctx, {y:sum()})
      st.opt:step(ctx)
      expect(st, close(dist_autograd.get_gradients(ctx)[st.x], st.gx), "the input's gradient")
    end)
  end})

workload("pipe", {kind = "calls", tasks = 2,
  setup = function()
    tensor.manual_seed(9)
    local seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    local st = {x = tensor.randn(16, 8), mse = nn.MSELoss()}
    st.y = st.x:sum(2, true)
    st.want = tensor.no_grad(function() return st.mse(seq(st.x), st.y):item() end) -- (lr 0: every step's loss)
    st.pipes, st.opts = {}, {}
    for j, schedule in ipairs({"gpipe", "1f1b"}) do
      st.pipes[j] = nn.Pipe(seq, {chunks = 4, placement = {"w1", "w2"}, balance = {2, 1}, schedule = schedule})
      st.opts[j] = rpc.DistributedOptimizer(optim.SGD, st.pipes[j]:parameter_rrefs(), {lr = 0})
    end
    return st
  end,
  step = function(st, i)
    local j = i % 2 + 1
    dist_autograd.context(function(ctx)
      local loss
      if j == 1 then
        local l = st.mse(st.pipes[1](st.x):to_here(), st.y)
        dist_autograd.backward(ctx, {l})
        loss = l:item()
      else
        loss = st.pipes[2]:train_step(st.x, st.y, st.mse)
      end
      st.opts[j]:step(ctx)
      expect(st, math.abs(loss - st.want) <= 1e-5 * math.max(1, math.abs(st.want)), "the pipe's loss")
    end)
  end})

workload("ddp", {kind = "spmd",
  setup = function()
    local function model()
      tensor.manual_seed(5)
      return nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    end
    local st = {}
    st.ddp = nn.DistributedDataParallel(model())
    st.opt = optim.SGD(st.ddp:parameters(), {lr = 0, momentum = 0.9})
    -- the gradients every rank must end with: the mean of each rank's own
    local ref, xs = model(), {}
    for r = 0, dist.get_world_size() - 1 do
      tensor.manual_seed(100 + r)
      xs[r] = tensor.randn(8, 32)
      local y = ref(xs[r]);
      (y * y):sum():backward()
    end
    st.want = {}
    for k, p in ipairs(ref:parameters()) do st.want[k] = p.grad / dist.get_world_size() end
    st.x = xs[rank]
    return st
  end,
  step = function(st)
    st.opt:zero_grad()
    local y = st.ddp(st.x)
    ;(y * y):sum():backward()
    local ok = true
    for k, p in ipairs(st.ddp:parameters()) do ok = ok and close(p.grad, st.want[k], 1e-4) end
    expect(st, ok, "DDP's averaged gradients")
    st.opt:step()
  end,
  teardown = function(st) st.ddp = nil end})

workload("collectives", {kind = "spmd",
  setup = function()
    return {g = dist.new_group({0, 1}), n = dist.get_world_size()}
  end,
  step = function(st, i)
    local n, k = st.n, i % 7
    local function one(group, size, members)
      local opts = group and {group = group} or nil
      local t = tensor.full({64}, rank + k)
      dist.all_reduce(t, opts)
      local sum = 0
      for _, r in ipairs(members) do sum = sum + r + k end
      expect(st, t:min():item() == sum and t:max():item() == sum, "all_reduce")
      local src = members[#members]
      local b = tensor.full({64}, rank == src and i or -1)
      dist.broadcast(b, src, opts)
      expect(st, b:min():item() == i and b:max():item() == i, "broadcast")
      local out = tensor.zeros(size * 16)
      dist.all_gather_into_tensor(out, tensor.full({16}, rank * 10 + k), opts)
      local good = true
      for j, r in ipairs(members) do
        local part = out:narrow(1, (j - 1) * 16 + 1, 16)
        good = good and part:min():item() == r * 10 + k and part:max():item() == r * 10 + k
      end
      expect(st, good, "all_gather_into_tensor")
      -- block j of this rank's input (8 floats) goes to member j: rank * 100 + j + k
      local me = 0
      for j, r in ipairs(members) do if r == rank then me = j - 1 end end
      local a2a_in, a2a_out = tensor.zeros(size * 8), tensor.zeros(size * 8)
      for j = 0, size - 1 do a2a_in:narrow(1, j * 8 + 1, 8):fill_(rank * 100 + j + k) end
      dist.all_to_all_single(a2a_out, a2a_in, opts)
      good = true
      for j, r in ipairs(members) do
        local part = a2a_out:narrow(1, (j - 1) * 8 + 1, 8)
        good = good and part:min():item() == r * 100 + me + k and part:max():item() == r * 100 + me + k
      end
      expect(st, good, "all_to_all_single")
      dist.barrier(opts)
    end
    local world = {}
    for r = 0, n - 1 do world[#world + 1] = r end
    one(nil, n, world)
    if st.g ~= dist.GroupMember.NON_GROUP_MEMBER then one(st.g, 2, {0, 1}) end
  end,
  teardown = function(st)
    if st.g ~= dist.GroupMember.NON_GROUP_MEMBER then dist.destroy_process_group(st.g) end
  end})

workload("remote_errors", {kind = "calls", tasks = 4,
  setup = function() return {} end,
  step = function(st, i)
    local ok, e = pcall(rpc.rpc_sync, peer(i), soak_raise, {i})
    expect(st, not ok and type(e) == "table" and e.kind == "remote"
      and tostring(e.message):find("soak error <" .. i .. ">", 1, true), e)
  end})

workload("timeouts", {kind = "calls", tasks = 8, settle = 2 * SLOW + 0.05,
  setup = function() return {} end,
  step = function(st, i)
    if i % 2 == 1 then
      local ok, e = pcall(rpc.rpc_sync, peer(i), soak_slow, {i}, nil, SHORT)
      if ok then
        -- the reply, read before the deadline's timer ran (the loop was busy
        -- past it), completed the call: right, but late (counted, not wrong)
        expect(st, e == i, "an answer past its timeout, and a wrong one")
        st.late = st.late + 1
      else
        expect(st, type(e) == "table" and e.kind == "timeout", e)
      end
    else
      expect(st, rpc.rpc_sync(peer(i), soak_echo, {i}) == i, "an answer between timeouts")
    end
  end})

-- (the variables a member must not inherit: it is no static rank)
local NOT_FOR_MEMBERS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RPCHOST_ERROR_FILE",
  "RPCHOST_STORE_HOSTED", "RPCHOST_RESTART_COUNT", "RPCHOST_TRACE", "RPCHOST_LAUNCHER_PID"}
workload("members", {kind = "calls", tasks = 2,
  -- (the binary this rank runs; when it was replaced meanwhile, a rebuild, the new one at its path)
  setup = function() return {exe = core.exepath():gsub(" %(deleted%)$", ""), script = arg[0]} end,
  step = function(st, i)
    local env = core.environ()
    for _, k in ipairs(NOT_FOR_MEMBERS) do env[k] = nil end
    env.SOAK_MEMBER, env.SOAK_I = "soak_visitor_" .. i, tostring(i)
    local list = {}
    for k, v in pairs(env) do list[#list + 1] = k .. "=" .. v end
    local done, err = rpc.Future(), {}
    local p, e = core.spawn{file = st.exe, args = {st.exe, st.script}, env = list, stdio = {"ignore", "ignore", "pipe"},
      output = function(_, chunk) if chunk and #err < 8 then err[#err + 1] = chunk end end,
      exit = function(status, signal) done:set_result(status, signal) end}
    assert(p, e)
    local ok, status, signal = pcall(done.wait, done, 60)
    if not ok then
      core.kill(p:pid(), core.SIGKILL) -- (a member that hangs is lost, and goes)
      error(("member %d did not leave within 60 s: %s"):format(i, table.concat(err)), 0)
    end
    expect(st, status == 0 and signal == 0, ("member %d exited with status %s, signal %s: %s"):format(i,
      tostring(status), tostring(signal), table.concat(err)))
  end})

-- running one workload ------------------------------------------------------------------------
-- The stretches, as shares of the run: the first tenth (its speed is the one
-- the last tenth's is compared with), the rest of the warm-up (none when the
-- warm-up is that tenth), checkpoint A, the middle, the last tenth, checkpoint
-- B; then, where a rank's heap grew, a census, one more tenth, and a census
-- again (after B: the census's own garbage disturbs no measurement).
local FIRST, MIDDLE, LAST = 1, 3, 4
local function stretches(warm)
  return {{share = 0.1}, {share = warm - 0.1, checkpoint = "A"}, {share = 0.9 - warm}, {share = 0.1, checkpoint = "B"}}
end
-- (heap growth from A to B that asks for a census)
local CENSUS_AT = {per_op = 0.25, bytes = 8192}

local function heap_grew(A, B, ops)
  local d = B.heap - A.heap
  return d > CENSUS_AT.bytes and d / math.max(ops, 1) >= CENSUS_AT.per_op
end

-- The operations done by the end of each tenth of a run's working time (the
-- stretches, not the checkpoints between them): a trend in speed shows as one,
-- a busy moment of a shared machine as a dip. (Made before A, full size: it
-- adds nothing to the heap between the checkpoints.)
local function tenths(seconds)
  local r = {at = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, n = 1, base = 0, t0 = 0, len = seconds / 10}
  function r.start() r.t0 = now() end
  function r.tick(ops)
    local t = r.base + now() - r.t0
    while r.n <= 10 and t >= r.n * r.len do
      r.at[r.n] = ops
      r.n = r.n + 1
    end
  end
  function r.stop(ops)
    r.base = r.base + now() - r.t0
    r.t0 = now()
    r.tick(ops)
  end
  -- ops/s in each tenth (a tenth the run ended before its end: its share)
  function r.rates(ops)
    while r.n <= 10 do r.at[r.n] = ops; r.n = r.n + 1 end
    local out, prev = {}, 0
    for i = 1, 10 do
      out[i] = (r.at[i] - prev) / r.len
      prev = r.at[i]
    end
    return out
  end
  return r
end

-- w0: waits until no rank's rpc.debug_info() changes between two rounds of
-- full collections (releases of RRefs, goodbyes of members, late replies done)
local function quiesce()
  local prev
  for _ = 1, 100 do
    local futs = {rpc.rpc_async("w1", soak_gc, {}), rpc.rpc_async("w2", soak_gc, {})}
    local infos = {soak_gc(), futs[1]:wait(), futs[2]:wait()}
    local keys = {}
    for r, d in ipairs(infos) do
      for k, v in pairs(d) do keys[#keys + 1] = r .. k .. "=" .. tostring(v) end
    end
    table.sort(keys)
    local key = table.concat(keys, ",")
    if key == prev then return end
    prev = key
    sched.sleep(0.05)
  end
end

-- w0: fn on every rank (here, then w1 and w2, one at a time), results by rank
local function on_all(fn, ...)
  local out = {[0] = fn(...)}
  for r = 1, 2 do out[r] = rpc.rpc_sync("w" .. r, fn, {...}) end
  return out
end

local function new_state(st)
  st.wrong, st.lost, st.late, st.why = 0, 0, 0, {}
  return st
end

local function lost(st, e)
  st.lost = st.lost + 1
  if #st.why < 3 then st.why[#st.why + 1] = "lost: " .. tostring(type(e) == "table" and e.message or e) end
end

-- kind "calls", on w0: each stretch run by `tasks` tasks until its end
local function run_calls(w, seconds, warm)
  local st = new_state(w.setup())
  local ops, by_tenth = 0, tenths(seconds)
  local function stretch(secs)
    local t0, o0, stop_at, futs = now(), ops, now() + secs, {}
    by_tenth.start()
    for t = 1, w.tasks do
      local f = rpc.Future()
      futs[t] = f
      sched.spawn(function()
        while now() < stop_at do
          ops = ops + 1
          local ok, e = pcall(w.step, st, ops)
          if not ok then lost(st, e) end
          by_tenth.tick(ops)
        end
        f:set_result(true)
      end)
    end
    -- (a stretch of a long soak lasts longer than the default limit of a wait,
    -- rpc_timeout: each task's end is bounded by the stretch itself)
    for _, f in ipairs(futs) do f:wait(secs + 120) end
    by_tenth.stop(ops)
    return ops - o0, now() - t0
  end
  local function settle()
    if w.settle then sched.sleep(w.settle) end
    quiesce()
  end
  local marks, cps = {}, {}
  for s = 1, 4 do marks[s] = {ops = 0, secs = 0} end -- (made before A: no growth of their own)
  for s, x in ipairs(stretches(warm)) do
    marks[s].ops, marks[s].secs = stretch(x.share * seconds)
    if x.checkpoint then
      settle()
      cps[#cps + 1] = on_all(soak_measure)
      if x.checkpoint == "A" then rebase(cps[1][0]) end
    end
  end
  local n = marks[MIDDLE].ops + marks[LAST].ops
  local res = {marks = marks, tenths = by_tenth.rates(ops), ranks = {}, wrong = st.wrong, lost = st.lost,
               late = st.late, why = st.why}
  local grew = false
  for r = 0, 2 do
    res.ranks[r] = {A = cps[1][r], B = cps[2][r], ops = n}
    grew = grew or heap_grew(cps[1][r], cps[2][r], n)
  end
  if grew then
    on_all(soak_census_first)
    stretch(0.1 * seconds)
    settle()
    res.census = on_all(soak_census_then)
  end
  if w.teardown then w.teardown(st) end
  return res
end

-- kind "spmd", on every rank (w1 and w2 run it in a call from w0): the same
-- steps everywhere; before each, w0's word in a broadcast: 1 go on, 0 stop here
function soak_spmd(name, seconds, warm)
  local w = W[name]
  local st = new_state(w.setup())
  local ctl = tensor.zeros(1)
  local ops, by_tenth = 0, tenths(seconds)
  local function stretch(secs)
    dist.barrier() -- (a stretch starts on every rank at once)
    local t0, o0, stop_at = now(), ops, now() + secs
    by_tenth.start()
    while true do
      if rank == 0 then ctl:fill_(now() < stop_at and 1 or 0) end
      dist.broadcast(ctl, 0)
      if ctl:item() == 0 then break end
      ops = ops + 1
      local ok, e = pcall(w.step, st, ops)
      if not ok then lost(st, e) end
      by_tenth.tick(ops)
    end
    by_tenth.stop(ops)
    dist.barrier()
    return ops - o0, now() - t0
  end
  local marks, cps = {}, {}
  for s = 1, 4 do marks[s] = {ops = 0, secs = 0} end -- (made before A: no growth of their own)
  for s, x in ipairs(stretches(warm)) do
    marks[s].ops, marks[s].secs = stretch(x.share * seconds)
    if x.checkpoint then
      cps[#cps + 1] = soak_measure()
      if x.checkpoint == "A" then rebase(cps[1]) end
    end
  end
  local n = marks[MIDDLE].ops + marks[LAST].ops
  local rates = by_tenth.rates(ops)
  local grew = tensor.full({1}, heap_grew(cps[1], cps[2], n) and 1 or 0)
  dist.all_reduce(grew, dist.ReduceOp.MAX)
  local census
  if grew:item() == 1 then
    soak_census_first()
    stretch(0.1 * seconds)
    census = soak_census_then()
  end
  if w.teardown then w.teardown(st) end
  return {marks = marks, tenths = rates, A = cps[1], B = cps[2], ops = n, census = census, wrong = st.wrong,
          lost = st.lost, late = st.late, why = st.why}
end

local function run_spmd(name, seconds, warm)
  local futs = {}
  for r = 1, 2 do futs[r] = rpc.rpc_async("w" .. r, soak_spmd, {name, seconds, warm}, nil, 0) end
  local res = {[0] = soak_spmd(name, seconds, warm)}
  for r = 1, 2 do res[r] = futs[r]:wait() end
  local out = {marks = res[0].marks, tenths = res[0].tenths, ranks = {}, wrong = 0, lost = 0, late = 0, why = {}}
  for r = 0, 2 do
    out.ranks[r] = {A = res[r].A, B = res[r].B, ops = res[r].ops}
    if res[r].census then
      out.census = out.census or {}
      out.census[r] = res[r].census
    end
    out.wrong, out.lost, out.late = out.wrong + res[r].wrong, out.lost + res[r].lost, out.late + res[r].late
    for _, y in ipairs(res[r].why) do out.why[#out.why + 1] = "w" .. r .. " " .. y end
  end
  return out
end

-- reporting ----------------------------------------------------------------------------------
local TARGET = {per_op = 1, total = 2 * 2^20, speed = 0.9}

local function kb(b) return ("%+.1f KB"):format(b / 1024) end

local function loadavg()
  local f = io.open("/proc/loadavg")
  local l = f and f:read("*l") or ""
  if f then f:close() end
  return l:match("^(%S+ %S+ %S+)") or "?"
end

-- the rpc.debug_info() counts not back at B to what they were at A
local function debug_changes(A, B)
  local out = {}
  for k, v in pairs(B.debug or {}) do
    local a = (A.debug or {})[k]
    if type(v) == "number" and a ~= v then out[#out + 1] = ("%s %s->%s"):format(k, tostring(a), tostring(v)) end
  end
  for k, a in pairs(A.debug or {}) do
    if (B.debug or {})[k] == nil then out[#out + 1] = ("%s %s->nil"):format(k, tostring(a)) end
  end
  table.sort(out)
  return out
end

local function speeds(marks)
  local first = marks[FIRST].ops / math.max(marks[FIRST].secs, 1e-9)
  local last = marks[LAST].ops / math.max(marks[LAST].secs, 1e-9)
  return first, last, first > 0 and last / first or 0
end

local function report(name, res, seconds)
  local first, last, ratio = speeds(res.marks)
  print(("\n%s: %d ops in %.0f s; first tenth %.0f ops/s, last tenth %.0f ops/s (%.2f); lost %d, wrong %d%s; " ..
    "load average %s"):format(name, res.marks[1].ops + res.marks[2].ops + res.marks[3].ops + res.marks[4].ops,
    seconds, first, last, ratio, res.lost, res.wrong, res.late > 0 and (", answered late %d"):format(res.late) or "",
    loadavg()))
  local t = {}
  for i, v in ipairs(res.tenths) do t[i] = ("%.0f"):format(v) end
  print("  ops/s by tenth: " .. table.concat(t, " "))
  for _, y in ipairs(res.why) do print("  " .. y) end
  print(("  %-4s %9s %10s %10s %11s %11s %8s %12s  %s"):format("rank", "ops A-B", "heap B/op", "RSS B/op", "heap",
    "RSS", "fds", "tensor B", "rpc.debug_info"))
  res.rows = {}
  for r = 0, 2 do
    local x = res.ranks[r]
    local dh, dr = x.B.heap - x.A.heap, x.B.rss - x.A.rss
    local n = math.max(x.ops, 1)
    local changes = debug_changes(x.A, x.B)
    local row = {rank = r, ops = x.ops, heap = dh, rss = dr, heap_op = dh / n, rss_op = dr / n, fds_a = x.A.fds,
                 fds_b = x.B.fds, tensor = x.B.tensor - x.A.tensor, changes = changes,
                 census = res.census and res.census[r] or {}}
    res.rows[r] = row
    print(("  w%-3d %9d %10.2f %10.2f %11s %11s %8s %12d  %s"):format(r, x.ops, row.heap_op, row.rss_op, kb(dh),
      kb(dr), x.A.fds .. "->" .. x.B.fds, row.tensor, #changes == 0 and "back" or table.concat(changes, ", ")))
    print(("SOAK w=%s rank=%d ops=%d heap=%.0f rss=%.0f fds=%d:%d tensor=%d first=%.1f last=%.1f lost=%d wrong=%d " ..
      "late=%d debug=%s")
      :format(name, r, x.ops, dh, dr, x.A.fds, x.B.fds, row.tensor, first, last, res.lost, res.wrong, res.late,
        #changes == 0 and "-" or table.concat(changes, ","):gsub(" ", ":")))
  end
  -- where resident memory grew
  for r = 0, 2 do
    local x = res.ranks[r]
    local kept = x.B.rss_kept - x.A.rss_kept
    if x.B.rss - x.A.rss >= 256 * 1024 or kept >= 256 * 1024 then
      local d = {}
      for _, k in ipairs({"Anon", "File", "Shmem"}) do
        d[#d + 1] = k:lower() .. " " .. kb(x.B.rss_parts[k] - x.A.rss_parts[k])
      end
      print(("  w%d's RSS: %s; with the pages malloc kept free, %s"):format(r, table.concat(d, ", "), kb(kept)))
    end
  end
  -- which descriptors came or went
  for r = 0, 2 do
    local x = res.ranks[r]
    if x.A.fds ~= x.B.fds then
      local d, seen = {}, {}
      for k, v in pairs(x.B.fd_kinds) do seen[k] = true; if (x.A.fd_kinds[k] or 0) ~= v then
        d[#d + 1] = ("%s %d->%d"):format(k, x.A.fd_kinds[k] or 0, v) end end
      for k, v in pairs(x.A.fd_kinds) do if not seen[k] then d[#d + 1] = ("%s %d->0"):format(k, v) end end
      for fd, t in pairs(x.B.fd_list) do
        if x.A.fd_list[fd] ~= t then d[#d + 1] = ("fd %s %s->%s"):format(fd, x.A.fd_list[fd] or "-", t) end
      end
      for fd, t in pairs(x.A.fd_list) do
        if not x.B.fd_list[fd] then d[#d + 1] = ("fd %s %s->-"):format(fd, t) end
      end
      table.sort(d)
      print(("  w%d's descriptors: %s"):format(r, table.concat(d, ", ")))
    end
  end
  -- where the heap grew: the census of that rank
  for r = 0, 2 do
    local row = res.rows[r]
    if #row.census > 0 and heap_grew(res.ranks[r].A, res.ranks[r].B, res.ranks[r].ops) then
      print(("  w%d's Lua heap grew %s; the tables that grew most in one more tenth (census):"):format(r,
        kb(row.heap)))
      for _, c in ipairs(row.census) do print("    " .. c) end
    end
  end
end

local function verdict(ok) return ok and "PASS" or "MISS" end

-- the targets of issue 37 (for a 30-minute run), beside what was measured
local function summary(results, names)
  print("\nTargets (issue 37; the targets are for a 30-minute run, every rank):")
  print(("  %-15s %-26s %-26s %-14s %-20s %-12s %s"):format("workload", "heap B/op (< 1)", "RSS B/op (< 1)",
    "fds constant", "last/first (>= 0.90)", "calls right", "debug_info back"))
  local all = true
  local total_heap, total_rss = {[0] = 0, 0, 0}, {[0] = 0, 0, 0}
  for _, name in ipairs(names) do
    local res = results[name]
    local mh, mr, fds, back = -math.huge, -math.huge, true, true
    for r = 0, 2 do
      local row = res.rows[r]
      mh, mr = math.max(mh, row.heap_op), math.max(mr, row.rss_op)
      fds = fds and row.fds_a == row.fds_b
      back = back and #row.changes == 0
      total_heap[r] = total_heap[r] + math.max(row.heap, 0)
      total_rss[r] = total_rss[r] + math.max(row.rss, 0)
    end
    local _, _, ratio = speeds(res.marks)
    local right = res.lost == 0 and res.wrong == 0
    local cells = {mh < TARGET.per_op, mr < TARGET.per_op, fds, ratio >= TARGET.speed, right, back}
    for _, c in ipairs(cells) do all = all and c end
    print(("  %-15s %-26s %-26s %-14s %-20s %-12s %s"):format(name,
      ("%.3f %s"):format(mh, verdict(cells[1])), ("%.3f %s"):format(mr, verdict(cells[2])), verdict(fds),
      ("%.2f %s"):format(ratio, verdict(cells[4])), verdict(right), verdict(back)))
  end
  for _, name in ipairs(names) do
    local late = results[name].late
    if late > 0 then
      print(("  %s: %d calls answered after their timeout had passed (with the right value: the reply was read " ..
        "before the deadline's timer ran)"):format(name, late))
    end
  end
  print("  growth in all, per rank (< 2 MB; the sum of each workload's growth from A to B):")
  for r = 0, 2 do
    local ok = total_heap[r] < TARGET.total and total_rss[r] < TARGET.total
    all = all and ok
    print(("    w%d: heap %s, RSS %s  %s"):format(r, kb(total_heap[r]), kb(total_rss[r]), verdict(ok)))
  end
  print(("SOAK_RESULT %s"):format(all and "PASS" or "MISS"))
  return all
end

-- the world ----------------------------------------------------------------------------------
if arg[1] == "--list" then -- (the workloads, one a line: spec/soak_spec.lua asks)
  print(table.concat(ORDER, "\n"))
  return
end
if tonumber(os.getenv("WORLD_SIZE")) ~= 3 then
  io.stderr:write("soak: run it as a world of three ranks: rpchost run --nproc-per-node 3 bench/soak.lua ... " ..
    "(or bench/soak.sh)\n")
  os.exit(2)
end

-- arguments: SECONDS [WORKLOADS] [strict] [warm=F]
local seconds = tonumber(arg[1]) or 60
local only = arg[2] or "all"
local strict, warm = false, 0.1
for i = 3, #arg do
  if arg[i] == "strict" then strict = true
  elseif arg[i]:match("^warm=") then warm = tonumber(arg[i]:match("^warm=(.*)$"))
  else warm = nil end
  if not warm or warm < 0.1 or warm > 0.8 then
    if rank == 0 then
      io.stderr:write(("soak: bad option %q: the options are strict and warm=F (0.1 <= F <= 0.8)\n"):format(arg[i]))
    end
    os.exit(2)
  end
end
local names = {}
if only == "all" then names = ORDER else
  for n in only:gmatch("[^,%s]+") do
    if not W[n] then
      if rank == 0 then
        io.stderr:write(("soak: no workload %q; the workloads are %s\n"):format(n, table.concat(ORDER, ", ")))
      end
      os.exit(2)
    end
    names[#names + 1] = n
  end
end

dist.init_process_group{backend = "gloo", timeout = 120}
rpc.init_rpc("w" .. rank, {rank = rank, world_size = 3,
  rpc_backend_options = rpc.TensorPipeRpcBackendOptions{rpc_timeout = 120}})
finished = rpc.Future()
function soak_finished() finished:set_result(true) end

local code = 0
if rank == 0 then
  print(("soak: %d workloads, %g s each (warm-up %g%%), 3 ranks; load average %s"):format(#names, seconds, warm * 100,
    loadavg()))
  local results = {}
  for _, name in ipairs(names) do
    local w = W[name]
    -- (what the workload before left in flight - its RRefs' releases after its
    -- teardown, say - drains first: an SPMD workload's A is taken on each rank
    -- without a quiesce of its own, and a count at A that the earlier workload
    -- still held read as this one's not coming back at B)
    quiesce()
    local res = w.kind == "spmd" and run_spmd(name, seconds, warm) or run_calls(w, seconds, warm)
    results[name] = res
    report(name, res, seconds)
    if res.lost > 0 or res.wrong > 0 then code = 1 end
    collectgarbage()
  end
  local pass = summary(results, names)
  if strict and not pass then code = 1 end
  for r = 1, 2 do rpc.rpc_sync("w" .. r, soak_finished, {}) end
else
  -- (as long as the driver's run takes, which may pass rpc_timeout, a program
  -- Future's default limit; if rank 0 fails, the launcher stops this rank)
  finished:wait(0)
end
rpc.shutdown()
dist.destroy_process_group()
if code ~= 0 then os.exit(code) end
