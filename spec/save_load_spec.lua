-- spec/save_load_spec.lua: saves that never lose the last good checkpoint
-- (issue 40, points 1 to 3), tried as a user meets them: a save killed with
-- SIGKILL at random instants, a full file system, a directory the process
-- cannot write, truncated and corrupt files, and the memory a big save or load
-- takes. Every save of a user's data goes through rpchost.atomic_file; its API
-- is checked here too, as the .pt writer and reader use it.
local S = require "spec.support"
local core = require "rpchost.core"
local tensor = require "tensor"
local nn = require "nn"

-- the names in dir
local function entries(dir)
  local out = {}
  local p = io.popen("ls -A '" .. dir .. "' 2>/dev/null")
  for line in p:lines() do out[#out + 1] = line end
  p:close()
  return out
end

-- the temporary files of saves to dir/name that are still there
local function leftovers(dir, name)
  local out = {}
  for _, e in ipairs(entries(dir)) do
    if e:sub(1, #name + 6) == "." .. name .. ".tmp-" then out[#out + 1] = e end
  end
  return out
end

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function fresh_dir(under)
  local d = ("%s/ck-%d-%d"):format(under or S.tmpdir, core.getpid(), math.random(1e9))
  assert(os.execute("mkdir -p '" .. d .. "'") == 0)
  return d
end

-- a directory in memory for the specs that write a lot (the kill loops): a
-- killed save is the same there as on a disk, and the disk is spared
local function memory_dir()
  local f = io.open("/dev/shm")
  if f then f:close(); return fresh_dir("/dev/shm") end
  return fresh_dir()
end

local function one_line(e) return type(e) == "string" and not e:find("\n", 1, true) end

describe("rpchost.atomic_file #unit", function()
  local atomic_file = require "rpchost.atomic_file"
  it("writes strings and tensors at the offset, rewrites what was written, and replaces the target at commit", function()
    local dir = fresh_dir()
    local path = dir .. "/x.bin"
    atomic_file.save(path, "the old file")
    local t = tensor.arange(0, 6, 1, {dtype = tensor.float64}):view(2, 3)
    local f = atomic_file.open(path, {size = 8 + 48 + 48, who = "spec"})
    local tmp = f:temp_path()
    assert.truthy(tmp and tmp:find("/.x.bin.tmp-", 1, true), tmp)
    assert.are.equal(8, f:write("HEAD", "ER.."))
    local crc, n = f:write_tensor(t, 0)
    assert.are.equal(48, n)
    local crc_t = f:write_tensor(t:t(), 0)  -- a transposed view: in logical order
    assert.is_nil((f:write_tensor(tensor.ones(0)))) -- (no crc asked, none computed)
    f:write_at(4, "er!!")
    assert.are.equal(104, f:offset())
    assert.are.equal("the old file", slurp(path)) -- (nothing is in place before the commit)
    f:commit()
    assert.is_nil(f:temp_path())
    assert.are.same({}, leftovers(dir, "x.bin"))
    local s = slurp(path)
    assert.are.equal(104, #s)
    assert.are.equal("HEADer!!", s:sub(1, 8))
    assert.are.equal(atomic_file.crc32(s:sub(9, 56)), crc)
    assert.are.equal(atomic_file.crc32(s:sub(57, 104)), crc_t)
    assert.are.equal(core.t_bytes(t:t():contiguous()), s:sub(57, 104))
    -- reading: byte ranges, into a tensor, or as a new tensor, with their crc
    local r = atomic_file.reader(path, "spec")
    assert.are.equal(104, r:size())
    assert.are.equal("HEADer!!", r:read(0, 8))
    local into = tensor.empty(2, 3, {dtype = tensor.float64})
    assert.are.equal(crc, r:read_into(8, into, {crc32 = true}))
    assert.is_true(into:equal(t))
    local back, crc2 = r:read_tensor(56, core.t_dtype(t), {3, 2}, {crc32 = true})
    assert.is_true(back:equal(t:t()))
    assert.are.equal(crc_t, crc2)
    -- (a crc continues the one given: header then data, as a zip member's)
    assert.are.equal(atomic_file.crc32(s:sub(1, 56)), r:read_into(8, into, {crc32 = atomic_file.crc32(s:sub(1, 8))}))
    local ok, e = pcall(r.read_into, r, 80, into)
    assert.is_false(ok)
    assert.truthy(one_line(e) and e:find("spec: " .. path .. " is truncated", 1, true), e)
    r:close()
  end)

  it("leaves the old file and no temporary file when a save is aborted, fails in its writer, or is dropped", function()
    local dir = fresh_dir()
    local path = dir .. "/y.npy"
    tensor.save(tensor.ones(3), path)
    local before = slurp(path)
    local f = atomic_file.open(path)
    f:write("half a checkpoint")
    f:abort()
    local ok, e = pcall(atomic_file.save, path, function(g)
      g:write("half")
      error("the writer failed")
    end)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("the writer failed", 1, true), e)
    local g = atomic_file.open(path)
    g:write("dropped")
    g = nil
    collectgarbage()
    collectgarbage()
    assert.are.equal(before, slurp(path))
    assert.are.same({}, leftovers(dir, "y.npy"))
    -- a value that is not a tensor is refused before the file is touched
    ok, e = pcall(nn.save, {a = tensor.ones(2), b = "text"}, dir .. "/z.npz")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("b is a string, not a tensor", 1, true), e)
    assert.is_nil(io.open(dir .. "/z.npz"))
    assert.are.same({}, leftovers(dir, "z.npz"))
  end)

  it("loads with {mmap = true} map the file copy-on-write, .npy and .npz members alike", function()
    local dir = fresh_dir()
    local t = tensor.randn(300, 70, {dtype = tensor.float64})
    tensor.save(t, dir .. "/m.npy")
    nn.save({head = tensor.ones(3), w = t, steps = tensor.arange(0, 7, 1, {dtype = tensor.int64})}, dir .. "/m.npz")
    local function mapped(path)
      local f = io.open("/proc/self/maps")
      local s = f:read("*a")
      f:close()
      return s:find(path, 1, true) ~= nil
    end
    local u = tensor.load(dir .. "/m.npy", {mmap = true})
    assert.is_true(u:equal(t))
    assert.is_true(mapped(dir .. "/m.npy"), "the .npy file is not mapped")
    u:mul_(2) -- (copy-on-write: the file keeps what was saved)
    assert.is_true(tensor.load(dir .. "/m.npy"):equal(t))
    local d = nn.load(dir .. "/m.npz", {mmap = true})
    assert.is_true(d.w:equal(t) and d.head:equal(tensor.ones(3)) and d.steps:equal(tensor.arange(0, 7, 1, {dtype = tensor.int64})))
    -- (every stored member's bytes start on a multiple of 64: each is mapped where it lies)
    assert.is_true(mapped(dir .. "/m.npz"), "the .npz members are not mapped")
    u, d = nil, nil
    collectgarbage()
    collectgarbage()
    assert.is_false(mapped(dir .. "/m.npy") or mapped(dir .. "/m.npz"), "a mapping outlived its tensors")
  end)

  it("saves strided tensors, and nn.save streams compressed and zip64 archives that numpy reads", function()
    local dir = fresh_dir()
    local m = tensor.randn(300, 70, {dtype = tensor.float64})
    tensor.save(m:t(), dir .. "/t.npy")
    assert.is_true(tensor.load(dir .. "/t.npy"):equal(m:t():contiguous()))
    local ser = require "rpchost.nn.serialize"
    -- big enough for several pieces when deflated; zip64 forced for every size and offset
    local sd = {big = tensor.arange(0, 3e6, 1, {dtype = tensor.int64}):view(1000, 3000):t(), small = tensor.ones(3),
                flags = tensor.tensor({true, false})}
    local at = ser.zip64_at
    ser.zip64_at = 0
    local ok, e = pcall(function()
      nn.save(sd, dir .. "/z64.npz")
      nn.save(sd, dir .. "/z64c.npz", {compressed = true})
    end)
    ser.zip64_at = at
    assert(ok, e)
    nn.save(sd, dir .. "/c.npz", {compressed = true})
    for _, name in ipairs({"z64.npz", "z64c.npz", "c.npz"}) do
      local back = nn.load(dir .. "/" .. name)
      for k, v in pairs(sd) do assert.is_true(back[k]:equal(v:contiguous()), name .. " " .. k) end
    end
    if os.execute("/usr/bin/python3 -c 'import numpy' 2>/dev/null") ~= 0 then return pending("no python3-numpy") end
    local p = io.popen(("/usr/bin/python3 -c \"import numpy as np, zipfile\n" ..
      "for n in ['z64.npz', 'z64c.npz', 'c.npz']:\n" ..
      "  d = np.load('%s/' + n); zipfile.ZipFile('%s/' + n).testzip()\n" ..
      "  print(n, d['big'].shape, int(d['big'][2999, 999]), d['small'].sum(), d['flags'].tolist())\""):format(dir, dir))
    local out = p:read("*a")
    p:close()
    for _, name in ipairs({"z64.npz", "z64c.npz", "c.npz"}) do
      assert.truthy(out:find(name .. " (3000, 1000) 2999999 3.0 [True, False]", 1, true), out)
    end
  end)
end)

-- The saving child of the kill loop: alternates two contents (every element
-- BASE+1, then BASE+2) as fast as it can until it is killed.
local SAVER = [[
local tensor, nn = require "tensor", require "nn"
local path, kind, base, n = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4])
local a, b = tensor.full({n}, base + 1), tensor.full({n}, base + 2)
print("ready")
io.stdout:flush()
for i = 1, math.huge do
  local t = i % 2 == 1 and a or b
  if kind == "tensor" then tensor.save(t, path)
  else nn.save({["0.weight"] = t, ["0.bias"] = t:narrow(1, 1, 1000), ["1.weight"] = t, ["1.bias"] = t}, path) end
end
]]

-- the one value every element of the checkpoint at path holds (raising when it
-- does not load, or is not whole)
local function content(kind, path, n)
  local ts = kind == "tensor" and {tensor.load(path)} or {}
  if kind == "nn" or kind == "pt" then
    local d = nn.load(path)
    for _, k in ipairs({"0.weight", "0.bias", "1.weight", "1.bias"}) do ts[#ts + 1] = assert(d[k], k) end
    assert(ts[2]:numel() == 1000)
  end
  local v = ts[1]:min():item()
  for i, t in ipairs(ts) do
    assert(i == 2 or t:numel() == n, "a tensor of the wrong size")
    assert(t:min():item() == v and t:max():item() == v, "a checkpoint that mixes two saves")
  end
  return v
end

local function save_as(kind, path, v, n)
  local t = tensor.full({n}, v)
  if kind == "tensor" then tensor.save(t, path)
  else nn.save({["0.weight"] = t, ["0.bias"] = t:narrow(1, 1, 1000), ["1.weight"] = t, ["1.bias"] = t}, path) end
end

describe("checkpoints under failure #world", function()
  it("a save killed at random instants leaves the old checkpoint or the new one, and the next save clears what it left", function()
    local dir = memory_dir()
    local script = S.write(SAVER)
    local n = 4 * 1048576 -- (16 MiB of float32 a tensor)
    for _, kind in ipairs({"tensor", "nn", "pt"}) do
      -- (pt: nn.save's PyTorch format, its tensors views of one storage)
      local name = kind == "tensor" and "ck.npy" or kind == "nn" and "ck.npz" or "ck.pt"
      local path = dir .. "/" .. name
      save_as(kind, path, 0, n)
      local allowed, killed_inside, rounds = {[0] = true}, 0, 30
      for round = 1, rounds do
        allowed[round * 10 + 1], allowed[round * 10 + 2] = true, true
        local h = S.start({script, path, kind, tostring(round * 10), tostring(n)})
        S.wait_until(function() return h.done or table.concat(h.out):find("ready", 1, true) end, 30,
          "the saving child to start")
        S.sleep(math.random() * 0.2)
        core.kill(h.pid, core.SIGKILL)
        local r = h:wait(20)
        assert.are.equal(core.SIGKILL, r.signal, "the saver ended by itself: " .. r.out .. r.err)
        local ok, v = pcall(content, kind, path, n)
        assert.is_true(ok, ("%s round %d: the checkpoint does not load after a kill: %s"):format(kind, round, v))
        assert.is_true(allowed[v], ("%s round %d: the checkpoint holds %s"):format(kind, round, tostring(v)))
        -- (the child's first save cleared the one before's leftovers: one at most)
        local left = leftovers(dir, name)
        assert.is_true(#left <= 1, table.concat(left, " "))
        if #left == 1 then killed_inside = killed_inside + 1 end
      end
      assert.is_true(killed_inside >= 3, ("%s: only %d of %d kills landed inside a save: this proved little"):format(
        kind, killed_inside, rounds))
      save_as(kind, path, 7, n)
      assert.are.same({}, leftovers(dir, name))
      assert.are.equal(7, content(kind, path, n))
    end
    os.execute("rm -rf '" .. dir .. "'")
  end)

  -- The saves of a child on a small tmpfs of its own (a private mount
  -- namespace; root only), after `setup` (a shell line, $D the directory).
  local CASES = [[
local tensor, nn = require "tensor", require "nn"
local dir, expect = os.getenv("D"), os.getenv("EXPECT")
local function check(name, cond, why)
  print((cond and "ok " or "FAIL ") .. name .. (cond and "" or (": " .. tostring(why))))
end
local old = tensor.arange(0, 1000, 1, {dtype = tensor.float32})
if os.getenv("STAGE") == "prepare" then
  tensor.save(old, dir .. "/ck.npy")
  nn.save({w = old}, dir .. "/ck.npz")
  nn.save({w = old}, dir .. "/ck.pt")
  return
end
local big = tensor.rand(1024, 1024) -- 4 MiB
local function no_temp()
  local p = io.popen("ls -A " .. dir)
  local s = p:read("*a")
  p:close()
  return not s:find(".tmp-", 1, true), s
end
for _, c in ipairs({
  {"tensor.save", "ck.npy", function() tensor.save(big, dir .. "/ck.npy") end, 4194432},
  {"nn.save", "ck.npz", function() nn.save({a = big, b = old}, dir .. "/ck.npz") end, 4194304 + 4000},
  {"nn.save compressed", "ck.npz", function() nn.save({a = big}, dir .. "/ck.npz", {compressed = true}) end, 0},
  {"nn.save .pt", "ck.pt", function() nn.save({a = big, b = old}, dir .. "/ck.pt") end, 4194304 + 4000},
}) do
  local what, path = c[1], dir .. "/" .. c[2]
  local ok, e = pcall(c[3])
  print("raised: " .. tostring(e))
  check("raises: " .. what, not ok, "it returned normally")
  e = tostring(e)
  check("one line naming the path: " .. what, not e:find("\n") and e:find("cannot save " .. path, 1, true), e)
  check("says what failed: " .. what, e:find(expect, 1, true), e)
  local need = tonumber(e:match("needs (%d+) bytes") or e:match("needs at least (%d+) bytes") or
    e:match("needs up to (%d+) bytes"))
  check("says how many bytes it needed: " .. what, need and need >= c[4], e)
  local same, back = pcall(c[2] == "ck.npy" and tensor.load or nn.load, path)
  if c[2] ~= "ck.npy" and same then back = back.w end
  check("leaves the old file: " .. what, same and back:equal(old), back)
  check("leaves no temporary file: " .. what, no_temp())
end
]]

  local function run_cases(setup, expect, skip_why)
    if core.getuid() ~= 0 then return pending(skip_why .. ": needs root (skipped)") end
    local dir = fresh_dir()
    local script = S.write(CASES)
    local shell = 'mount -t tmpfs -o size=1m tmpfs "$D" || exit 77; ' .. setup
    local r = S.run({script}, {prefix = {"unshare", "-m", "--propagation", "private", "sh", "-c", shell, "sh"},
      env = {D = dir, EXPECT = expect}, timeout = 60})
    if r.status == 77 then return pending(skip_why .. ": cannot mount a tmpfs here (skipped): " .. r.err) end
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end

  it("a full file system: every save raises one line with the path, the cause and the bytes needed, and the old file stays", function()
    run_cases('STAGE=prepare "$@" && "$@"', "No space left on device",
      "a full file system")
  end)

  it("a read-only directory: every save raises one line with the path, the cause and the bytes needed, and the old file stays", function()
    run_cases('STAGE=prepare "$@" && mount -o remount,ro "$D" && "$@"', "Read-only file system",
      "a read-only directory")
  end)

  it("a directory the user may not write: the same, as another user", function()
    if core.getuid() ~= 0 then return pending("a directory another user owns: needs root to switch users (skipped)") end
    if os.execute("command -v setpriv >/dev/null") ~= 0 then return pending("no setpriv to switch users (skipped)") end
    run_cases('chmod 755 "$D" && STAGE=prepare "$@" && chmod 644 "$D"/* && ' ..
      'setpriv --reuid=65534 --regid=65534 --clear-groups "$@"', "Permission denied", "a directory of another user")
  end)

  it("truncated and corrupt .npy and .npz files load with a clear error or as they were, never a crash", function()
    local dir = fresh_dir()
    local script = S.write([[
local tensor, nn, bit = require "tensor", require "nn", require "bit"
local dir = os.getenv("D")
math.randomseed(tonumber(os.getenv("SEED")))
local function check(name, cond, why)
  print((cond and "ok " or "FAIL ") .. name .. (cond and "" or (": " .. tostring(why))))
end
local t = tensor.randn(7, 5, {dtype = tensor.float64})
local sd = {w = t, steps = tensor.arange(0, 10, 1, {dtype = tensor.int64}), mask = tensor.tensor({true, false})}
tensor.save(t, dir .. "/a.npy")
nn.save(sd, dir .. "/a.npz")
nn.save(sd, dir .. "/c.npz", {compressed = true})
local function bytes(p) local f = io.open(p, "rb"); local s = f:read("*a"); f:close(); return s end
local originals = {npy = bytes(dir .. "/a.npy"), npz = bytes(dir .. "/a.npz"), npzc = bytes(dir .. "/c.npz")}
local bad, counts = {}, {refused = 0, loaded = 0}
-- loads data as a file of kind; what it gives must be an error of one line
-- naming the file, or (npz) exactly what was saved, or (npy) a tensor of its shape
local function try(kind, data, how)
  local path = dir .. "/fuzz." .. (kind == "npy" and "npy" or "npz")
  local f = io.open(path, "wb"); f:write(data); f:close()
  local ok, res = pcall(kind == "npy" and tensor.load or nn.load, path)
  local who = kind == "npy" and "tensor.load: " or "nn.load: "
  if not ok then
    counts.refused = counts.refused + 1
    if type(res) ~= "string" or res:find("\n") or res:sub(1, #who + #path) ~= who .. path then
      bad[#bad + 1] = ("%s %s: an unclear error: %s"):format(kind, how, tostring(res))
    end
    return false
  end
  counts.loaded = counts.loaded + 1
  if kind == "npy" then
    if res:numel() ~= 35 then bad[#bad + 1] = kind .. " " .. how .. ": loaded a tensor of another size" end
  else
    for k, v in pairs(sd) do
      if not (res[k] and res[k].dtype == v.dtype and res[k]:equal(v)) then
        bad[#bad + 1] = ("%s %s: loaded %s changed, unnoticed"):format(kind, how, k)
      end
    end
  end
  return true
end
local n = 0
for kind, orig in pairs(originals) do
  for _ = 1, 40 do
    local cut = math.random(0, #orig - 1)
    n = n + 1
    if try(kind, orig:sub(1, cut), "cut to " .. cut .. " bytes") then
      bad[#bad + 1] = kind .. " cut to " .. cut .. " bytes loaded"
    end
  end
  for _ = 1, 80 do
    local at, k = math.random(1, #orig), math.random(0, 7)
    local flipped = string.char(bit.bxor(orig:byte(at), bit.lshift(1, k)))
    n = n + 1
    try(kind, orig:sub(1, at - 1) .. flipped .. orig:sub(at + 1), "bit " .. k .. " of byte " .. at .. " flipped")
  end
end
print(("fuzzed %d files: %d refused, %d loaded"):format(n, counts.refused, counts.loaded))
check("every damaged file is refused in one clear line or loads as it was saved", #bad == 0, table.concat(bad, "\n"))
check("most damaged files are refused", counts.refused > n / 2, counts.refused)
]])
    local r = S.run({script}, {env = {D = dir, SEED = math.random(1e6)}, timeout = 120})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  -- the process's peak resident memory, reset and read (for the two specs
  -- below; under AddressSanitizer with its quarantine off, which would keep
  -- every freed piece resident)
  local ASAN_OPTIONS = ((os.getenv("ASAN_OPTIONS") or "") .. ":quarantine_size_mb=0"):gsub("^:", "")
  local PEAK = [==[
local MiB = 1048576
local function check(name, cond, why)
  print((cond and "ok " or "FAIL ") .. name .. (cond and "" or (": " .. tostring(why))))
end
local function reset() local f = io.open("/proc/self/clear_refs", "w"); f:write("5"); f:close() end
local function peak()
  local f = io.open("/proc/self/status"); local s = f:read("*a"); f:close()
  return tonumber(s:match("VmHWM:%s*(%d+)")) * 1024
end
-- fn's result, and the bytes of resident memory it added at its peak
local function measured(fn)
  collectgarbage(); collectgarbage()
  reset()
  local base = peak()
  local r = fn()
  return peak() - base, r
end
]==]

  it("saves stream from the tensors and loads read into them: at most 64 MiB above the tensors", function()
    local dir = fresh_dir()
    local script = S.write(PEAK .. [[
local tensor, nn = require "tensor", require "nn"
local dir = os.getenv("D")
local t = tensor.rand(32 * MiB) -- 128 MiB
local above = measured(function() tensor.save(t, dir .. "/big.npy") end)
check("tensor.save takes at most 64 MiB above the tensor", above <= 64 * MiB, above / MiB .. " MiB")
local grew, back = measured(function() return tensor.load(dir .. "/big.npy") end)
check("tensor.load takes at most 64 MiB above the tensor it makes", grew <= (128 + 64) * MiB, grew / MiB .. " MiB")
check("tensor.load gives what was saved", back:equal(t))
back = nil
local sd = {a = t:narrow(1, 1, 16 * MiB), b = t:narrow(1, 16 * MiB + 1, 16 * MiB):view(4096, 4096):t()}
above = measured(function() nn.save(sd, dir .. "/big.npz") end)
check("nn.save takes at most 64 MiB above its tensors", above <= 64 * MiB, above / MiB .. " MiB")
grew, back = measured(function() return nn.load(dir .. "/big.npz") end)
check("nn.load takes at most 64 MiB above the tensors it makes", grew <= (128 + 64) * MiB, grew / MiB .. " MiB")
check("nn.load gives what was saved", back.a:equal(sd.a) and back.b:equal(sd.b))
]])
    local r = S.run({script}, {env = {D = dir, ASAN_OPTIONS = ASAN_OPTIONS}, timeout = 120})
    os.execute("rm -rf '" .. dir .. "'")
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  -- kernels/emulated.cpp keeps "device" memory on the host: a CUDA tensor's
  -- save goes through the same device-to-host copies as on a GPU
  it("a CUDA tensor is saved through copies of a few MiB (the emulated device)", function()
    local lib = S.bin:match("^(.*)/[^/]*$") .. "/librpchost_emulated.so"
    local f = io.open(lib)
    if not f then return pending("librpchost_emulated.so was not built (no C++ compiler): " .. lib) end
    f:close()
    local dir = fresh_dir()
    local script = S.write(PEAK .. [[
local tensor, nn = require "tensor", require "nn"
local dir = os.getenv("D")
local d = tensor.rand(16 * MiB):cuda() -- 64 MiB on the device
local above = measured(function() tensor.save(d, dir .. "/dev.npy") end)
check("tensor.save of a device tensor copies it in bounded pieces", above <= 16 * MiB, above / MiB .. " MiB")
check("a device tensor loads as it was saved", tensor.load(dir .. "/dev.npy"):equal(d:cpu()))
local dt = d:view(4096, 4096):t()
above = measured(function() nn.save({w = dt}, dir .. "/dev.npz") end)
check("nn.save of a strided device tensor copies it in bounded pieces", above <= 16 * MiB, above / MiB .. " MiB")
check("a strided device tensor loads as it was saved", nn.load(dir .. "/dev.npz").w:equal(dt:cpu()))
]])
    local r = S.run({script}, {env = {D = dir, RPCHOST_CUDA_LIB = lib, ASAN_OPTIONS = ASAN_OPTIONS}, timeout = 120})
    os.execute("rm -rf '" .. dir .. "'")
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
end)
