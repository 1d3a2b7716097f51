-- SummaryWriter (rpchost.summary; PyTorch's torch.utils.tensorboard)
-- and `rpchost plot`: the event files it writes are read back by
-- spec/tfevents_reader.lua, a reader written from the format's definition
-- (record framing, both CRC32Cs, protobuf by field number) that shares
-- nothing with the writer; writes are buffered yet reach the file at flush,
-- after flush_secs, at the script's end, at os.exit and at SIGTERM; a failed
-- write raises one line naming the file; each rank of a world writes its own
-- directory under one run directory; the plot is one HTML file with nothing
-- fetched, a curve per run per tag, smoothed as TensorBoard smooths.
local S = require "spec.support"
local R = require "spec.tfevents_reader"
local core = require "rpchost.core"

local function fresh_dir(name)
  local dir = S.tmpdir .. "/summary_" .. name
  os.execute("rm -rf '" .. dir .. "'")
  return dir
end

local function ls(pattern)
  local out = {}
  local p = io.popen("ls -d " .. pattern .. " 2>/dev/null")
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  return out
end

local function event_files(dir) return ls("'" .. dir .. "'/events.out.tfevents.*") end

local function the_events(dir)
  local files = event_files(dir)
  assert.are.equal(1, #files, "event files in " .. dir .. ": " .. table.concat(files, " "))
  return R.events(files[1]), files[1]
end

local function scalars(events, tag)
  local out = {}
  for _, e in ipairs(events) do
    for _, v in ipairs(e.values or {}) do
      if v.tag == tag and v.simple_value then out[#out + 1] = {step = e.step, value = v.simple_value, wall = e.wall_time} end
    end
  end
  return out
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

describe("SummaryWriter's event files #unit", function()
  local summary = require "rpchost.summary"
  local SummaryWriter = summary.SummaryWriter
  local tensor = require "tensor"

  it("computes CRC32C and TFRecord's mask as the format defines them", function()
    local tfevents = require "rpchost.tfevents"
    local zeros, ones, up = ("\0"):rep(32), ("\255"):rep(32), {}
    for i = 0, 31 do up[#up + 1] = string.char(i) end
    up = table.concat(up)
    -- (RFC 3720 B.4's CRC32C test vectors, and the usual check value)
    for s, want in pairs({["123456789"] = 0xE3069283, [zeros] = 0x8A9136AA, [ones] = 0x62A8AB43,
                          [up] = 0x46DD794E}) do
      assert.are.equal(want, R.crc32c(s))
      assert.are.equal(want, tfevents.crc32c(s))
      assert.are.equal(R.masked(want), tfevents.masked_crc32c(s))
    end
  end)

  it("writes scalars that a reader written from the format reads back, both CRCs checked", function()
    local dir = fresh_dir("scalars")
    local t0 = require("rpc").time()
    local w = SummaryWriter{log_dir = dir}
    assert.are.equal(dir, w.log_dir)
    assert.are.equal(dir, w:get_logdir())
    for i = 1, 100 do w:add_scalar("train/loss", 1 / i, i) end
    w:add_scalar("big_step", 2.5, 2 ^ 40)
    w:add_scalar("int64_step", -1.5, -3LL)
    w:add_scalar("tensor_value", tensor.tensor({0.75}), 7)
    w:add_scalar("no_step", 9)
    w:add_scalar("walltime", 1, 1, 1234.5)
    w:close()
    local events, path = the_events(dir)
    assert.truthy(path:match("/events%.out%.tfevents%.%d%d%d%d%d%d%d%d%d%d%." .. core.hostname():gsub("%p", "%%%0") ..
      "%." .. core.getpid() .. "%.%d+$"), path)
    assert.are.equal("brain.Event:2", events[1].file_version)
    assert.is_true(events[1].wall_time >= t0 - 1 and events[1].wall_time <= require("rpc").time() + 1)
    local loss = scalars(events, "train/loss")
    assert.are.equal(100, #loss)
    for i, s in ipairs(loss) do
      assert.are.equal(i, tonumber(s.step))
      assert.are.equal(R.as_f32(1 / i), s.value)
      assert.is_true(s.wall >= t0 - 1)
    end
    assert.are.equal(2 ^ 40, tonumber(scalars(events, "big_step")[1].step))
    assert.are.equal(-3, tonumber(scalars(events, "int64_step")[1].step))
    assert.are.equal(0.75, scalars(events, "tensor_value")[1].value)
    assert.is_nil(scalars(events, "no_step")[1].step) -- (as PyTorch: no global_step, no step field)
    assert.are.equal(1234.5, scalars(events, "walltime")[1].wall)
  end)

  it("writes histograms as PyTorch does: its default bins, min, max, num, sum, sum of squares", function()
    local dir = fresh_dir("histograms")
    local w = SummaryWriter{log_dir = dir}
    tensor.manual_seed(3)
    local x = tensor.randn(5000)
    w:add_histogram("weights", x, 1)
    w:add_histogram("list", {1, 2, 3, 3}, 2, 4)
    w:add_histogram("ints", tensor.tensor({1, 5, 5, 9}, {dtype = tensor.int64}), 3)
    w:add_histogram("opts", {0.5, 1.5}, 4, {bins = 2})
    w:close()
    local events = the_events(dir)
    local h = {}
    for _, e in ipairs(events) do
      for _, v in ipairs(e.values or {}) do if v.histo then h[v.tag] = v.histo end end
    end
    -- numpy's bins over {1, 2, 3, 3} with 4 bins: edges 1, 1.5, 2, 2.5, 3, counts
    -- 1, 0, 1, 2; an empty bin leads (TensorBoard reads right edges only)
    assert.are.same({1, 1.5, 2, 2.5, 3}, h.list.bucket_limit)
    assert.are.same({0, 1, 0, 1, 2}, h.list.bucket)
    assert.are.same({1, 3, 4, 9, 23}, {h.list.min, h.list.max, h.list.num, h.list.sum, h.list.sum_squares})
    assert.are.same({0, 1, 1}, h.opts.bucket)
    -- the randn tensor: its statistics in double, its buckets on PyTorch's edges
    local vals = x:double():totable()
    local lo, hi, sum, sq = math.huge, -math.huge, 0, 0
    for _, v in ipairs(vals) do lo, hi, sum, sq = math.min(lo, v), math.max(hi, v), sum + v, sq + v * v end
    local g = h.weights
    assert.are.same({lo, hi, 5000}, {g.min, g.max, g.num})
    assert.is_true(math.abs(g.sum - sum) < 1e-9 and math.abs(g.sum_squares - sq) < 1e-6)
    local edges, v = {[0] = true}, 1e-12
    while v < 1e20 do edges[v] = true; edges[-v] = true; v = v * 1.1 end
    assert.are.equal(#g.bucket, #g.bucket_limit)
    assert.are.equal(0, g.bucket[1])
    local total = 0
    for k, limit in ipairs(g.bucket_limit) do
      assert.is_true(edges[limit], "not one of PyTorch's default edges: " .. limit)
      if k > 1 then assert.is_true(limit > g.bucket_limit[k - 1]) end
      local n = 0
      for _, val in ipairs(vals) do
        if k > 1 and val >= g.bucket_limit[k - 1] and val < limit then n = n + 1 end
      end
      if k == #g.bucket_limit then
        for _, val in ipairs(vals) do if val == limit then n = n + 1 end end
      end
      assert.are.equal(n, g.bucket[k], "bucket " .. k)
      total = total + g.bucket[k]
    end
    assert.are.equal(5000, total)
    assert.are.same({1, 9, 4, 20}, {h.ints.min, h.ints.max, h.ints.num, h.ints.sum})
  end)

  it("writes text where TensorBoard's text plugin finds it", function()
    local dir = fresh_dir("text")
    local w = SummaryWriter{log_dir = dir}
    w:add_text("notes", "lr = 0.1, *batch* 32\nsecond line", 5)
    w:close()
    local events = the_events(dir)
    local e = events[2]
    assert.are.equal(5, tonumber(e.step))
    local v = e.values[1]
    assert.are.equal("notes/text_summary", v.tag)
    assert.are.equal("text", v.plugin_name)
    assert.are.same({dtype = 7, strings = {"lr = 0.1, *batch* 32\nsecond line"}, dims = {1}}, v.tensor) -- (7: DT_STRING)
  end)

  it("puts add_scalars' series in runs of their own, each under the main tag, as PyTorch does", function()
    local dir = fresh_dir("scalars_group")
    local w = SummaryWriter(dir)
    for i = 1, 3 do w:add_scalars("loss/all", {train = i, test = 2 * i}, i) end
    w:close()
    assert.are.same({dir .. "/loss_all_test", dir .. "/loss_all_train"}, ls("'" .. dir .. "'/loss_all_*"))
    local test = scalars(the_events(dir .. "/loss_all_test"), "loss/all")
    local train = scalars(the_events(dir .. "/loss_all_train"), "loss/all")
    assert.are.same({2, 4, 6}, {test[1].value, test[2].value, test[3].value})
    assert.are.same({1, 2, 3}, {train[1].value, train[2].value, train[3].value})
    assert.are.equal(1, #(R.events(event_files(dir)[1]))) -- (the main file: its header only)
  end)

  it("buffers: records reach the file at flush, flush_secs after the first, or once 64 KiB wait", function()
    local dir = fresh_dir("buffered")
    local w = SummaryWriter{log_dir = dir, flush_secs = 0.3}
    local path = event_files(dir)[1]
    assert.are.equal(1, #R.records(path)) -- (the header, at once)
    w:add_scalar("a", 1, 1)
    assert.are.equal(1, #R.records(path))
    S.wait_until(function() return #R.records(path) == 2 end, 10, "the record, flush_secs after it was added")
    w:add_scalar("a", 2, 2)
    w:flush()
    assert.are.equal(3, #R.records(path))
    local slow = SummaryWriter{log_dir = dir .. "/slow"}
    local spath = event_files(dir .. "/slow")[1]
    for i = 1, 3000 do slow:add_scalar("many", i, i) end
    local n = #R.records(spath)
    assert.is_true(n > 1000 and n < 3001, n .. " records written before the flush")
    slow:close()
    w:close()
    assert.are.equal(3001, #R.records(spath))
  end)

  it("raises one line naming the file when a write fails, and writes what waited once it can", function()
    local dir = fresh_dir("full")
    local w = SummaryWriter{log_dir = dir}
    local path = event_files(dir)[1]
    local saved = read(path)
    os.remove(path)
    assert(os.execute("ln -s /dev/full '" .. path .. "'") == 0)
    w:add_scalar("x", 1, 1)
    local ok, err = pcall(w.flush, w)
    assert.is_false(ok)
    assert.truthy(err:find("SummaryWriter: cannot write " .. path, 1, true), err)
    assert.truthy(err:find("No space left on device", 1, true), err)
    assert.is_nil(err:find("\n"), err)
    os.remove(path)
    local f = assert(io.open(path, "wb"))
    f:write(saved)
    f:close()
    w:add_scalar("x", 2, 2)
    w:close()
    local x = scalars(R.events(path), "x")
    assert.are.same({1, 2}, {x[1].value, x[2].value})
    -- a directory removed under the writer
    local gone = fresh_dir("gone")
    local w2 = SummaryWriter{log_dir = gone}
    os.execute("rm -rf '" .. gone .. "'")
    w2:add_scalar("x", 1, 1)
    ok, err = pcall(w2.close, w2)
    assert.is_false(ok)
    assert.truthy(err:find("SummaryWriter: cannot write " .. gone .. "/events.out.tfevents.", 1, true), err)
    assert.truthy(err:find("No such file or directory", 1, true), err)
  end)

  it("refuses what it cannot write with one line naming it", function()
    local w = SummaryWriter{log_dir = fresh_dir("refusals")}
    local function msg(f, ...)
      local ok, e = pcall(f, ...)
      assert.is_false(ok)
      return e
    end
    assert.are.equal('SummaryWriter: add_scalar("loss"): the value must be a number or a one-element tensor, got string',
      msg(w.add_scalar, w, "loss", "high"))
    assert.are.equal("SummaryWriter: add_scalar: global_step must be a whole number (or an int64), got 1.5",
      msg(w.add_scalar, w, "loss", 1, 1.5))
    assert.truthy(msg(w.add_scalar, w, "loss", tensor.ones(3)):find("got a tensor of 3 elements", 1, true))
    assert.are.equal('SummaryWriter: add_histogram("h"): no values (an empty tensor or list)', msg(w.add_histogram, w, "h", {}))
    assert.truthy(msg(w.add_histogram, w, "h", {1}, 1, "fd"):find('bins must be "tensorflow" or a whole number', 1, true))
    assert.truthy(msg(SummaryWriter, {logdir = "x"}):find("unknown option logdir", 1, true))
    assert.are.equal("SummaryWriter.add_scalar: call it as a method, w:add_scalar(...)", msg(w.add_scalar, "loss", 1))
    w:close()
  end)

  it("writes a restart's purge_step as TensorBoard expects it (a session START at that step)", function()
    local dir = fresh_dir("purge")
    local w = SummaryWriter{log_dir = dir, purge_step = 40}
    w:close()
    local events = the_events(dir)
    assert.are.equal("brain.Event:2", events[1].file_version)
    assert.are.same({"brain.Event:2", 40}, {events[2].file_version, tonumber(events[2].step)})
    assert.are.same({1, 40}, {events[3].session_status, tonumber(events[3].step)})
  end)

  it("reopens after close with a new event file, as PyTorch does", function()
    local dir = fresh_dir("reopen")
    local w = SummaryWriter{log_dir = dir}
    w:add_scalar("a", 1, 1)
    w:close()
    w:add_scalar("a", 2, 2)
    w:close()
    assert.are.equal(2, #event_files(dir))
  end)
end)

describe("rpchost plot, drawing #unit", function()
  local plot = require "rpchost.tools.plot"
  local SummaryWriter = require("rpchost.summary").SummaryWriter

  it("smooths as TensorBoard does: a debiased exponential moving average", function()
    local vals = {}
    math.randomseed(5)
    for i = 1, 50 do vals[i] = math.random() * 10 end
    vals[20] = 0 / 0
    local got = plot.smooth(vals, 0.6)
    local last, n = 0, 0
    for i, v in ipairs(vals) do
      if v ~= v then
        assert.is_true(got[i] ~= got[i])
      else
        last, n = last * 0.6 + 0.4 * v, n + 1
        assert.is_true(math.abs(got[i] - last / (1 - 0.6 ^ n)) < 1e-12, "point " .. i)
      end
    end
    assert.are.equal(vals[1], got[1]) -- (debiased: the first point is itself)
    assert.are.same({3, 3, 3}, plot.smooth({3, 3, 3}, 0.9))
  end)

  it("draws each run of each tag into one page that fetches nothing", function()
    local dir = fresh_dir("plot")
    for r = 0, 2 do
      local w = SummaryWriter{log_dir = dir .. "/rank" .. r}
      for i = 1, 30 do
        w:add_scalar("loss", 2 / i + r, i)
        w:add_scalar("lr", 0.1, i)
      end
      w:add_histogram("weights", {1, 2, 3 + r}, 1)
      w:add_text("config", "<b>rank</b> " .. r, 0)
      w:close()
    end
    local runs = plot.runs(dir)
    assert.are.same({"rank0", "rank1", "rank2"}, {runs[1].name, runs[2].name, runs[3].name})
    for _, run in ipairs(runs) do plot.load(run) end
    local html = plot.render(runs, {title = "t", logdir = dir, smoothing = 0.6})
    for _, tag in ipairs({"loss", "lr", "weights"}) do
      for r = 0, 2 do
        assert.truthy(html:find(('<path class="smoothed" data-run="rank%d" data-tag="%s"'):format(r, tag), 1, true),
          ("no curve for rank%d's %s"):format(r, tag))
      end
    end
    assert.truthy(html:find("&lt;b&gt;rank&lt;/b&gt; 2", 1, true)) -- (text escaped)
    for _, remote in ipairs({"http:", "https:", "//", "src=", "href=", "url(", "@import", "<script", "<link"}) do
      assert.is_nil(html:find(remote, 1, true), "the page refers to something outside it: " .. remote)
    end
  end)

  it("plots a file its writer is still writing, and names a damaged one", function()
    local dir = fresh_dir("plot_damaged")
    local w = SummaryWriter{log_dir = dir}
    for i = 1, 5 do w:add_scalar("loss", i, i) end
    w:close()
    local path = event_files(dir)[1]
    local s = read(path)
    local f = assert(io.open(path, "wb"))
    f:write(s:sub(1, #s - 5)) -- (the last record cut short, as a writer mid-write leaves it)
    f:close()
    local run = plot.load(plot.runs(dir)[1])
    assert.are.equal(4, #run.scalars.loss.steps)
    assert.truthy(run.warnings[1]:find("cut short", 1, true), run.warnings[1])
    f = assert(io.open(path, "wb"))
    f:write(s:sub(1, 40) .. "\255" .. s:sub(42))
    f:close()
    local ok, err = pcall(plot.load, plot.runs(dir)[1])
    assert.is_false(ok)
    assert.truthy(err:find(path .. ": the ", 1, true) and err:find("CRC of the record at byte %d+ does not match"), err)
  end)
end)

describe("SummaryWriter in processes and worlds #world", function()
  local function count_scalars(dir, tag)
    local n = 0
    for _, path in ipairs(ls("'" .. dir .. "'/events.out.tfevents.*")) do n = n + #scalars(R.events(path), tag) end
    return n
  end

  it("writes what waited when the script ends, at os.exit, and when stopped by SIGTERM", function()
    local body = [[
      local w = require("rpchost.summary").SummaryWriter{log_dir = os.getenv("LOGDIR")}
      for i = 1, 500 do w:add_scalar("loss", i, i) end
    ]]
    local ends = fresh_dir("at_end")
    local r = S.run({S.write(body)}, {env = {LOGDIR = ends}})
    assert.are.equal(0, r.status, r.err)
    assert.are.equal(500, count_scalars(ends, "loss"))
    local exits = fresh_dir("at_exit")
    r = S.run({S.write(body .. "os.exit(0)")}, {env = {LOGDIR = exits}})
    assert.are.equal(0, r.status, r.err)
    assert.are.equal(500, count_scalars(exits, "loss"))
    local stopped = fresh_dir("at_sigterm")
    local h = S.start({S.write(body .. "print('ready') io.stdout:flush() require('rpc').sleep(60)")},
      {env = {LOGDIR = stopped}})
    S.wait_until(function() return table.concat(h.out):find("ready", 1, true) end, 30, "the script to be ready")
    h:kill(core.SIGTERM)
    local res = h:wait(20)
    assert.is_false(res.timed_out)
    assert.are.equal(500, count_scalars(stopped, "loss"))
  end)

  it("gives each rank of a world its own directory under one run directory, and plots them overlaid", function()
    local cwd = fresh_dir("world")
    os.execute("mkdir -p '" .. cwd .. "'")
    local r = S.world(2, S.prelude .. [[
      dist.init_process_group{backend = "gloo"}
      require("rpc").sleep(rank * 1.1) -- (the ranks' clocks name different seconds)
      local w = require("rpchost.summary").SummaryWriter()
      print("log_dir " .. w.log_dir)
      for i = 1, 20 do w:add_scalar("loss", 1 / i + rank, i) end
      w:close()
      dist.barrier()
      dist.destroy_process_group()
    ]], {cwd = cwd, timeout = 90})
    assert.are.equal(0, r.status, r.out .. r.err)
    local dirs = {}
    for d in r.out:gmatch("log_dir (%S+)") do dirs[#dirs + 1] = d end
    table.sort(dirs)
    assert.are.equal(2, #dirs, r.out)
    local run = dirs[1]:match("^(runs/%u%l%l%d%d_%d%d%-%d%d%-%d%d_[^/]+)/rank0$")
    assert.truthy(run, dirs[1])
    assert.are.equal(run .. "/rank1", dirs[2])
    assert.are.equal(20, count_scalars(cwd .. "/" .. dirs[2], "loss"))
    -- and rpchost plot draws both ranks' curves
    local p = S.run({"plot", run, "-o", "curves.html"}, {cwd = cwd})
    assert.are.equal(0, p.status, p.err)
    assert.truthy(p.out:find("wrote curves.html (1 tag, 2 runs)", 1, true), p.out)
    local html = read(cwd .. "/curves.html")
    assert.truthy(html:find('data-run="rank0" data-tag="loss"', 1, true))
    assert.truthy(html:find('data-run="rank1" data-tag="loss"', 1, true))
    assert.is_nil(html:find("http", 1, true))
    -- one process outside any world: PyTorch's runs/<Mon DD_HH-MM-SS>_<host>
    local one = S.run({"-e", 'print(require("rpchost.summary").SummaryWriter{comment = "_x"}.log_dir)'}, {cwd = cwd})
    assert.are.equal(0, one.status, one.err)
    assert.truthy(one.out:match("^runs/%u%l%l%d%d_%d%d%-%d%d%-%d%d_" .. core.hostname():gsub("%p", "%%%0") .. "_x\n$"),
      one.out)
  end)

  it("sends a rank restarted in place back to its first life's directory", function()
    local cwd = fresh_dir("restarted")
    os.execute("mkdir -p '" .. cwd .. "'")
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      local life = os.getenv("LIFE") or "only"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      local w = require("rpchost.summary").SummaryWriter()
      print("log_dir " .. w.log_dir)
      w:add_scalar("loss", life == "second" and 2 or 1, life == "second" and 2 or 1)
      if life == "first" then w:flush(); os.exit(3) end
      if rank == 0 then
        wait_until(function()
          return pcall(rpc.rpc_sync, "w1", "tostring", {1}, nil, 2)
        end, 30, "w1's second life", 0.1)
      end
      w:close()
      rpc.shutdown()
    ]])
    local function start(rk, life)
      return S.start({path}, {cwd = cwd, env = {RANK = rk, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1",
                                               MASTER_PORT = port, LIFE = life}})
    end
    local h0, first = start(0), start(1, "first")
    local r1a = first:wait(30)
    assert.are.equal(3, r1a.status, r1a.err)
    local r1b, r0 = start(1, "second"):wait(60), h0:wait(60)
    assert.are.equal(0, r0.status, r0.out .. r0.err)
    assert.are.equal(0, r1b.status, r1b.out .. r1b.err)
    local d0, d1a, d1b = r0.out:match("log_dir (%S+)"), r1a.out:match("log_dir (%S+)"), r1b.out:match("log_dir (%S+)")
    assert.truthy(d0 and d0:match("/rank0$"), r0.out)
    assert.are.equal(d0:gsub("rank0$", "rank1"), d1a)
    assert.are.equal(d1a, d1b)
    assert.are.equal(2, #event_files(cwd .. "/" .. d1a))
    assert.are.equal(2, count_scalars(cwd .. "/" .. d1a, "loss"))
  end)

  it("rpchost plot says what is wrong: no LOGDIR, no event files, --help", function()
    local empty = fresh_dir("plot_empty")
    os.execute("mkdir -p '" .. empty .. "'")
    local r = S.run({"plot", empty})
    assert.are.equal(1, r.status)
    assert.truthy(r.err:find("no event files (events.out.tfevents.*) under " .. empty, 1, true), r.err)
    r = S.run({"plot"})
    assert.are.equal(2, r.status)
    assert.truthy(r.err:find("which LOGDIR?", 1, true), r.err)
    r = S.run({"plot", "--help"})
    assert.are.equal(0, r.status)
    assert.truthy(r.out:find("usage: rpchost plot LOGDIR", 1, true))
  end)
end)
