-- rpchost.nn.summary: SummaryWriter, torch.utils.tensorboard's, writing the
-- event files TensorBoard reads (rpchost.tfevents frames and encodes them);
-- rpchost.summary is its face. Same names and arguments as
-- PyTorch's: SummaryWriter{log_dir=, comment=, purge_step=, max_queue=,
-- flush_secs=, filename_suffix=}, add_scalar, add_scalars, add_histogram,
-- add_text, flush, close, log_dir.
--
-- Where a writer writes, by default: PyTorch's runs/<Mon DD_HH-MM-SS>_<host>,
-- and in a world one directory per rank under one run directory,
-- runs/<stamp>_<host>/rank<r>. The ranks agree on the run directory through the
-- store of their process group (or RPC agent) when one is up: the first
-- rank's stamp and host win, so every rank lands beside the others whatever
-- its clock says, and a rank restarted in place (`--max-restarts`) writes a new
-- event file into its old directory. A rank that knows its rank only from the
-- environment (no group yet) names the run from its own clock.
--
-- Writes are buffered: each writer's records are written out (appended; event
-- files are append-only logs, read while they grow) once 64 KiB are waiting,
-- flush_secs (120) after the first record waiting, on flush() and close(),
-- and at exit: when the script ends, when the process is stopped by SIGINT or
-- SIGTERM, and at os.exit. A write that fails raises one line naming the file
-- and why, and leaves the file as it was before that write (whole records
-- only); one that fails where nothing can be raised (a timer, the exit) is
-- printed then, and raised by the next add_* to that file.
local ffi = require "ffi"
local buffer = require "string.buffer"
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local compat = require "rpchost.compat"
local env = require "rpchost.env"
local tfevents = require "rpchost.tfevents"
local tensor = require "rpchost.tensor"

local M = {}

local FLUSH_BYTES = 64 * 1024

-- (the wall clock under rpchost's own name, bindings/l_loop.c: declaring
-- libc's clock_gettime with a struct of ours would fix its type for every
-- script in the process)
pcall(ffi.cdef, "double rh_clock_wall(void);")
-- (each alone: a declaration another module made already fails only itself)
pcall(ffi.cdef, "int mkdir(const char *path, unsigned int mode);")
pcall(ffi.cdef, "int truncate(const char *path, long length);")
pcall(ffi.cdef, "char *strerror(int errnum);")
local function wall_time() return ffi.C.rh_clock_wall() end

-- (one line, no position: the message names the call and the argument)
local function fail(fmt, ...) error(("SummaryWriter: " .. fmt):format(...), 0) end

-- mkdir -p, without a shell (a log_dir may hold any character)
local function make_dirs(dir)
  local path = ""
  for part in dir:gmatch("[^/]+") do
    path = (path == "" and dir:sub(1, 1) ~= "/") and part or (path .. "/" .. part)
    if ffi.C.mkdir(path, 511) ~= 0 and ffi.errno() ~= 17 then -- (17: EEXIST)
      local why = ffi.string(ffi.C.strerror(ffi.errno()))
      fail("cannot make the log directory %s: %s (%s; give another log_dir)", dir, why, path)
    end
  end
end

-- FileWriter: one event file and the records waiting for it ------------------
local FileWriter = {}
FileWriter.__index = FileWriter

local open_writers = {} -- [FileWriter] = true: flushed at exit (held here until closed)
local uid = 0           -- (PyTorch's global counter: two files of one process in one second differ)

local function flush_due(fw)
  fw.deadline = nil
  local ok, err = pcall(fw.write_out, fw)
  if not ok then
    fw.failed = err
    io.stderr:write("rpchost: ", tostring(err), "\n")
  end
end

function FileWriter.new(dir, o)
  make_dirs(dir)
  local path = ("%s/events.out.tfevents.%010d.%s.%d.%d%s"):format(dir, os.time(), core.hostname() or "localhost",
    core.getpid(), uid, o.filename_suffix or "")
  uid = uid + 1
  local fw = setmetatable({dir = dir, path = path, buf = buffer.new(), flush_secs = o.flush_secs}, FileWriter)
  tfevents.file_version(fw.buf, wall_time())
  fw:write_out() -- (the file exists at once, as PyTorch's does)
  open_writers[fw] = true
  return fw
end

-- appends what waits to the file; a failed write is cut off again, so the file
-- holds whole records only, and what waited still waits
function FileWriter:write_out()
  if self.deadline then sched.cancel(self.deadline); self.deadline = nil end
  if #self.buf == 0 then return end
  local f, err = io.open(self.path, "ab")
  local size = f and f:seek("end")
  local ok, werr = false, nil
  if size then ok, werr = f:write(self.buf:tostring()) end
  local closed, cerr = true, nil
  if f then closed, cerr = f:close() end
  if not (ok and closed) then
    if size then ffi.C.truncate(self.path, size) end
    local why = tostring(err or werr or cerr or ffi.string(ffi.C.strerror(ffi.errno())))
    if why:sub(1, #self.path + 2) == self.path .. ": " then why = why:sub(#self.path + 3) end -- (io.open's)
    error(("SummaryWriter: cannot write %s: %s (%d bytes of events wait in memory; free space, fix the " ..
      "directory's permissions, or give another log_dir)"):format(self.path, why, #self.buf), 0)
  end
  self.buf:reset()
  self.failed = nil
end

-- after a record was appended to self.buf
function FileWriter:wrote()
  if self.failed then
    local err = self.failed
    self.failed = nil
    error(err, 0)
  end
  if #self.buf >= FLUSH_BYTES then return self:write_out() end
  if not self.deadline then self.deadline = sched.after(self.flush_secs, flush_due, self) end
end

function FileWriter:close()
  open_writers[self] = nil
  self:write_out()
end

local function flush_all()
  for fw in pairs(open_writers) do
    local ok, err = pcall(fw.write_out, fw)
    if not ok then io.stderr:write("rpchost: ", tostring(err), "\n") end
  end
end

-- (once: the end of the script, SIGINT/SIGTERM, and os.exit)
local hooked = false
local function hook_exit()
  if hooked then return end
  hooked = true
  sched.at_exit(flush_all)
  sched.on_terminate(flush_all, M)
  compat.before_exit(flush_all)
end

-- where the default log_dir goes -----------------------------------------------
-- this process's rank, and the store of its world if a process group or RPC
-- agent is up (a module not loaded has nothing up: nothing is loaded for the
-- asking). The store lives as long as the world, and a rank restarted in place
-- meets the same one.
local function world()
  local g = package.loaded["rpchost.dist"] and require("rpchost.dist")._group()
  if g and g.store then return g.rank, g.store end
  local a = package.loaded["rpchost.rpc"] and require("rpchost.rpc")._agent()
  if a and a.store then return a.rank, a.store end
  return env.rank()
end

-- The n-th default writer of each rank shares the n-th run directory: the first
-- rank to make it names it (its time and host); a restarted rank counts from 1
-- again and finds its first life's directory.
local default_count = 0
local function default_log_dir(comment)
  local mine = os.date("%b%d_%H-%M-%S") .. "_" .. (core.hostname() or "localhost")
  local rank, store = world()
  if rank == nil then return "runs/" .. mine .. comment end
  default_count = default_count + 1
  local run = store and store:compare_set("rpchost/summary/run/" .. default_count, "", mine) or mine
  return ("runs/%s%s/rank%d"):format(run, comment, rank)
end

-- SummaryWriter ------------------------------------------------------------------
local SummaryWriter = {}
SummaryWriter.__index = SummaryWriter
local new_writer
M.SummaryWriter = setmetatable(SummaryWriter, {__call = function(_, o) return new_writer(o) end})

local function number_opt(o, k, default)
  local v = o[k]
  if v == nil then return default end
  if type(v) ~= "number" or v < 0 then fail("%s must be a non-negative number, got %s", k, tostring(v)) end
  return v
end

-- SummaryWriter(log_dir) or SummaryWriter{log_dir=, comment=, purge_step=,
-- max_queue=, flush_secs=, filename_suffix=}
function new_writer(o)
  if type(o) == "string" then o = {log_dir = o} end
  o = o or {}
  if type(o) ~= "table" then fail("expected a log_dir or an options table, got %s", type(o)) end
  for k in pairs(o) do
    if not ({log_dir = 1, comment = 1, purge_step = 1, max_queue = 1, flush_secs = 1, filename_suffix = 1})[k] then
      fail("unknown option %s (log_dir, comment, purge_step, max_queue, flush_secs, filename_suffix)", tostring(k))
    end
  end
  local log_dir = o.log_dir
  if log_dir ~= nil and (type(log_dir) ~= "string" or log_dir == "") then
    fail("log_dir must be a directory path, got %s", tostring(log_dir))
  end
  local w = setmetatable({
    log_dir = log_dir or default_log_dir(tostring(o.comment or "")),
    -- (max_queue bounds PyTorch's queue to its writer thread; here records
    -- wait in memory until 64 KiB: accepted, and nothing else to bound)
    max_queue = number_opt(o, "max_queue", 10),
    flush_secs = number_opt(o, "flush_secs", 120),
    filename_suffix = tostring(o.filename_suffix or ""),
    purge_step = o.purge_step,
  }, SummaryWriter)
  w:_file()
  return w
end

local function check_self(w, method)
  if getmetatable(w) ~= SummaryWriter then
    error(("SummaryWriter.%s: call it as a method, w:%s(...)"):format(method, method), 0)
  end
end

-- the default file writer, made again after close() (as PyTorch does)
function SummaryWriter:_file()
  if self.file then return self.file end
  hook_exit()
  local fw = FileWriter.new(self.log_dir, self)
  self.file, self.writers = fw, {[self.log_dir] = fw}
  if self.purge_step ~= nil then
    -- TensorBoard drops what this run logged at purge_step or later before now
    local t = wall_time()
    tfevents.file_version(fw.buf, t, self.purge_step)
    tfevents.session_start(fw.buf, t, self.purge_step)
    fw:write_out()
    self.purge_step = nil
  end
  return fw
end

function SummaryWriter:get_logdir() return self.log_dir end

local function step_of(method, step)
  if step == nil then return nil end
  if type(step) == "cdata" and (ffi.istype("int64_t", step) or ffi.istype("uint64_t", step)) then return step end
  if type(step) ~= "number" or step ~= math.floor(step) or step ~= step or math.abs(step) >= 2 ^ 63 then
    fail("%s: global_step must be a whole number (or an int64), got %s", method, tostring(step))
  end
  return step
end

local function walltime_of(method, t)
  if t == nil then return wall_time() end
  if type(t) == "table" then t = t.walltime; if t == nil then return wall_time() end end
  if type(t) ~= "number" then fail("%s: walltime must be seconds since the epoch, got %s", method, tostring(t)) end
  return t
end

local function tag_of(method, tag)
  if type(tag) ~= "string" or tag == "" then
    fail("%s: tag must be a non-empty string, got %s", method, tostring(tag))
  end
  return tag
end

local function scalar_of(method, tag, v)
  if type(v) == "number" then return v end
  if tensor.is_tensor(v) and v:numel() == 1 then return v:item() end
  if type(v) == "cdata" then
    local ok, n = pcall(tonumber, v)
    if ok and n then return n end
  end
  fail("%s(%q): the value must be a number or a one-element tensor, got %s", method, tag,
    tensor.is_tensor(v) and ("a tensor of " .. v:numel() .. " elements") or type(v))
end

-- add_scalar(tag, value, global_step, walltime)
function SummaryWriter:add_scalar(tag, value, step, walltime)
  check_self(self, "add_scalar")
  tag = tag_of("add_scalar", tag)
  local v = scalar_of("add_scalar", tag, value)
  local fw = self.file or self:_file()
  tfevents.scalar(fw.buf, walltime_of("add_scalar", walltime), step_of("add_scalar", step), tag, v)
  return fw:wrote()
end

-- add_scalars(main_tag, {tag = value, ...}, global_step, walltime): each tag's
-- values go to a run of their own, log_dir/<main_tag>_<tag>, under main_tag:
-- TensorBoard then draws them in one chart (PyTorch's layout)
function SummaryWriter:add_scalars(main_tag, values, step, walltime)
  check_self(self, "add_scalars")
  main_tag = tag_of("add_scalars", main_tag)
  if type(values) ~= "table" then
    fail("add_scalars(%q): expected a table {tag = value}, got %s", main_tag, type(values))
  end
  local t, s = walltime_of("add_scalars", walltime), step_of("add_scalars", step)
  local tags = {}
  for k in pairs(values) do tags[#tags + 1] = tostring(k) end
  table.sort(tags)
  self:_file()
  local lookup = {}
  for k, v in pairs(values) do lookup[tostring(k)] = v end
  for _, k in ipairs(tags) do
    local v = scalar_of("add_scalars", main_tag .. "/" .. k, lookup[k])
    local dir = self.log_dir .. "/" .. main_tag:gsub("/", "_") .. "_" .. k
    local fw = self.writers[dir]
    if not fw then
      fw = FileWriter.new(dir, self)
      self.writers[dir] = fw
    end
    tfevents.scalar(fw.buf, t, s, main_tag, v)
    fw:wrote()
  end
end

-- histograms --------------------------------------------------------------------
-- PyTorch's default bins ("tensorflow"): 0 and +-1e-12 * 1.1^k up to 1e20,
-- computed the same way so the edges are the same numbers
local TF_EDGES
local function tf_edges()
  if TF_EDGES then return TF_EDGES end
  local pos, v = {}, 1e-12
  while v < 1e20 do pos[#pos + 1] = v; v = v * 1.1 end
  local n = 2 * #pos + 1
  local e = ffi.new("double[?]", n)
  for i = 1, #pos do e[#pos - i] = -pos[i]; e[#pos + i] = pos[i] end
  e[#pos] = 0
  TF_EDGES = {e = e, n = n}
  return TF_EDGES
end

local anchor = {}

-- the values as a double or float pointer, their count, and what keeps them alive
local function values_of(tag, values)
  if tensor.is_tensor(values) then
    local t = values:detach()
    if t.dtype ~= tensor.float32 and t.dtype ~= tensor.float64 then t = t:double() end
    local s = core.t_bytes(t)
    local ct = t.dtype == tensor.float32 and "const float *" or "const double *"
    return ffi.cast(ct, s), t:numel(), s
  end
  if type(values) ~= "table" then
    fail("add_histogram(%q): values must be a tensor or a list of numbers, got %s", tag, type(values))
  end
  local n = #values
  local a = ffi.new("double[?]", math.max(n, 1))
  for i = 1, n do
    local v = values[i]
    if type(v) ~= "number" then
      fail("add_histogram(%q): values[%d] is %s, not a number", tag, i, type(v))
    end
    a[i - 1] = v
  end
  return a, n, a
end

-- the bin of x among edges e[0..n-1] (bins [e[i], e[i+1]), the last one closed;
-- values outside the edges go to the end bins)
local function bin_of(e, n, x)
  local lo, hi = 0, n - 2
  if x >= e[hi] then return hi end
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if e[mid] <= x then lo = mid else hi = mid - 1 end
  end
  return lo
end

-- HistogramProto's fields for values p[0..n-1] (non-finite values left out):
-- PyTorch's make_histogram, numpy's bins kept from the first non-empty bin to
-- the last, with one empty bin before them (TensorBoard reads only right edges)
local function histogram(tag, p, n, bins)
  local lo, hi, num, sum, sq = math.huge, -math.huge, 0, 0, 0
  for i = 0, n - 1 do
    local x = p[i]
    if x == x and x ~= math.huge and x ~= -math.huge then
      if x < lo then lo = x end
      if x > hi then hi = x end
      num, sum, sq = num + 1, sum + x, sq + x * x
    end
  end
  if n == 0 then fail("add_histogram(%q): no values (an empty tensor or list)", tag) end
  if num == 0 then fail("add_histogram(%q): no finite values to draw (%d given)", tag, n) end
  local e, ne
  if bins == "tensorflow" then
    local t = tf_edges()
    e, ne = t.e, t.n
  else
    local a, b = lo, hi
    if a == b then a, b = a - 0.5, b + 0.5 end
    ne = bins + 1
    e = ffi.new("double[?]", ne)
    for i = 0, bins do e[i] = a + (b - a) * i / bins end
  end
  local counts = ffi.new("double[?]", ne - 1)
  for i = 0, n - 1 do
    local x = p[i]
    if x == x and x ~= math.huge and x ~= -math.huge then
      local k = bin_of(e, ne, x)
      counts[k] = counts[k] + 1
    end
  end
  local first, last = nil, 0
  for k = 0, ne - 2 do
    if counts[k] > 0 then first = first or k; last = k end
  end
  local limits, bucket = {}, {}
  for k = first, last + 1 do limits[#limits + 1] = e[k] end
  bucket[1] = first > 0 and counts[first - 1] or 0
  for k = first, last do bucket[#bucket + 1] = counts[k] end
  return {min = lo, max = hi, num = num, sum = sum, sum_squares = sq, bucket_limit = limits, bucket = bucket}
end

-- add_histogram(tag, values, global_step, bins, walltime); bins "tensorflow"
-- (the default) or a number of equal bins between the values' min and max;
-- the options may come as a table instead: {bins =, walltime =}
function SummaryWriter:add_histogram(tag, values, step, bins, walltime)
  check_self(self, "add_histogram")
  tag = tag_of("add_histogram", tag)
  if type(bins) == "table" then bins, walltime = bins.bins, bins.walltime end
  bins = bins or "tensorflow"
  if bins ~= "tensorflow" and not (type(bins) == "number" and bins >= 1 and bins == math.floor(bins)) then
    fail("add_histogram(%q): bins must be \"tensorflow\" or a whole number of bins, got %s", tag, tostring(bins))
  end
  local p, n, keep = values_of(tag, values)
  anchor[1] = keep -- (p points into keep: it must not be collected meanwhile)
  local h = histogram(tag, p, n, bins)
  anchor[1] = nil
  local fw = self.file or self:_file()
  tfevents.histogram(fw.buf, walltime_of("add_histogram", walltime), step_of("add_histogram", step), tag, h)
  return fw:wrote()
end

-- add_text(tag, text, global_step, walltime): TensorBoard's text plugin shows it
-- (as Markdown) under tag .. "/text_summary", the tag PyTorch gives it
function SummaryWriter:add_text(tag, text, step, walltime)
  check_self(self, "add_text")
  tag = tag_of("add_text", tag)
  if type(text) ~= "string" then fail("add_text(%q): text must be a string, got %s", tag, type(text)) end
  local fw = self.file or self:_file()
  tfevents.text(fw.buf, walltime_of("add_text", walltime), step_of("add_text", step), tag .. "/text_summary", text)
  return fw:wrote()
end

-- flush(): every record added so far is in the files
function SummaryWriter:flush()
  check_self(self, "flush")
  for _, fw in pairs(self.writers or {}) do fw:write_out() end
end

-- close(): flush, and let the files go; a later add_* starts a new event file
function SummaryWriter:close()
  check_self(self, "close")
  local writers = self.writers or {}
  self.file, self.writers = nil, nil
  local first
  for _, fw in pairs(writers) do
    local ok, err = pcall(fw.close, fw)
    first = first or (not ok and err)
  end
  if first then error(first, 0) end
end

return M
