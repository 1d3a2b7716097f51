-- rpchost.nn.data: tensor.data, PyTorch's torch.utils.data for in-memory data:
-- TensorDataset, DataLoader (batch_size, shuffle with a seed, drop_last, a
-- sampler such as DistributedSampler), and readers that turn files into
-- tensors: .npy, .npz and CSV (gzipped too). Indices are 1-based.
-- Datasets, samplers and loaders are sized objects (rpchost.sized): `#loader` is
-- its count of batches, `#ds` of items, `#sampler` of indices, as Python's len().
local sized = require "rpchost.sized"

local M = {}

function M.install(tensor)
  local D = {}
  tensor.data = D

  -- (a dataset or sampler: one of ours, a table of the user's with methods, or a list)
  local is_object = sized.is_object
  local function has(v, method) return is_object(v) and type(v[method]) == "function" end
  local function len_of(ds)
    if has(ds, "len") then return ds:len() end
    if type(ds) == "table" then return #ds end
    error("data: a dataset needs a len() method (or is a Lua list)", 3)
  end
  -- how to take item i of ds: its get method, or indexing a list
  local function index_list(list, i) return list[i] end
  local function getter(ds) return has(ds, "get") and ds.get or index_list end

  -- TensorDataset(t1, t2, ...): item i is {t1[i], t2[i], ...}
  local TensorDataset = {name = "TensorDataset", __sized = true}
  TensorDataset.__index = TensorDataset
  D.TensorDataset = setmetatable(TensorDataset, {__call = function(_, ...)
    local ts = {...}
    if #ts == 0 then error("TensorDataset: give at least one tensor", 2) end
    for i, t in ipairs(ts) do
      if not tensor.is_tensor(t) or t:dim() < 1 then error(("TensorDataset: argument %d is not a tensor with a first dimension"):format(i), 2) end
      if t:size(1) ~= ts[1]:size(1) then
        error(("TensorDataset: size mismatch between tensors (%d and %d rows)"):format(ts[1]:size(1), t:size(1)), 2)
      end
    end
    return sized.new(setmetatable({tensors = ts}, TensorDataset))
  end})
  function TensorDataset:len() return self.tensors[1]:size(1) end
  function TensorDataset:get(i)
    local out = {}
    for k, t in ipairs(self.tensors) do out[k] = t[i] end
    return out
  end
  -- a whole batch at once (DataLoader uses this when it exists)
  function TensorDataset:get_batch(idx)
    local it = tensor.tensor(idx, {dtype = tensor.int64})
    local out = {}
    for k, t in ipairs(self.tensors) do out[k] = t:index_select(1, it) end
    return out
  end

  -- a seeded permutation of 1..n (Park-Miller), the same on every host for a seed
  local function permutation(n, seed)
    local idx = {}
    for i = 1, n do idx[i] = i end
    local x = (seed * 1000003 + 12345) % 2147483647
    if x == 0 then x = 1 end
    for i = n, 2, -1 do
      x = (x * 48271) % 2147483647
      local j = x % i + 1
      idx[i], idx[j] = idx[j], idx[i]
    end
    return idx
  end

  -- stacks the items of one batch: tensors stack, numbers become a tensor,
  -- tables collate field by field
  local function collate(items)
    local first = items[1]
    if tensor.is_tensor(first) then return tensor.stack(items, 1) end
    if type(first) == "number" then return tensor.tensor(items) end
    if type(first) == "table" then
      local out = {}
      for k in pairs(first) do
        local col = {}
        for i, it in ipairs(items) do col[i] = it[k] end
        out[k] = collate(col)
      end
      return out
    end
    return items
  end
  D.default_collate = collate

  -- DataLoader(dataset, {batch_size = 1, shuffle = false, seed =, drop_last = false,
  -- sampler =, collate_fn =}); for x, y in loader:iter() do ... end (each call of
  -- iter() is one epoch; a seeded shuffle differs per epoch, the same on every run)
  local DataLoader = {name = "DataLoader", __sized = true}
  DataLoader.__index = DataLoader
  D.DataLoader = setmetatable(DataLoader, {__call = function(_, ds, o)
    o = o or {}
    require("rpchost.errors").check_options(o, {"batch_size", "shuffle", "seed", "drop_last", "sampler", "collate_fn",
      "num_workers", "pin_memory"}, "DataLoader")
    local n = len_of(ds)
    local bs = o.batch_size
    if bs == nil then bs = 1 end
    if type(bs) ~= "number" or bs < 1 or bs % 1 ~= 0 then
      error("DataLoader: batch_size should be a positive integer value, but got batch_size=" .. tostring(bs), 2)
    end
    if o.sampler ~= nil and o.shuffle then
      error("DataLoader: sampler option is mutually exclusive with shuffle", 2)
    end
    return sized.new(setmetatable({dataset = ds, n = n, batch_size = bs, shuffle = o.shuffle and true or false,
      seed = o.seed, drop_last = o.drop_last and true or false, sampler = o.sampler, collate_fn = o.collate_fn,
      epoch = 0}, DataLoader))
  end})

  function DataLoader:indices()
    local s = self.sampler
    if s ~= nil then
      if has(s, "indices") then return s:indices() end
      if type(s) == "table" then return s end
      error("DataLoader: a sampler is a list of indices or has an indices() method", 3)
    end
    if self.shuffle then
      if self.seed ~= nil then return permutation(self.n, self.seed + self.epoch * 7919) end
      return tensor.randperm(self.n):totable()
    end
    local idx = {}
    for i = 1, self.n do idx[i] = i end
    return idx
  end

  -- the count of batches per epoch (also #loader)
  function DataLoader:len()
    local s, n = self.sampler, self.n
    if has(s, "len") then n = s:len()
    elseif s ~= nil then n = #self:indices() end
    if self.drop_last then return math.floor(n / self.batch_size) end
    return math.ceil(n / self.batch_size)
  end

  -- iter(): yields each batch's fields (x, y for a TensorDataset of two)
  function DataLoader:iter()
    local idx = self:indices()
    self.epoch = self.epoch + 1
    local pos = 1
    local ds = self.dataset
    local batch_of = self.collate_fn == nil and has(ds, "get_batch") and ds.get_batch
    local get = not batch_of and getter(ds)
    return function()
      if pos > #idx then return nil end
      local last = math.min(pos + self.batch_size - 1, #idx)
      if self.drop_last and last - pos + 1 < self.batch_size then return nil end
      local ids = {}
      for i = pos, last do ids[#ids + 1] = idx[i] end
      pos = last + 1
      local batch
      if batch_of then
        batch = batch_of(ds, ids)
      else
        local items = {}
        for i, id in ipairs(ids) do items[i] = get(ds, id) end
        batch = (self.collate_fn or collate)(items)
      end
      if type(batch) == "table" and not tensor.is_tensor(batch) and #batch > 0 then return unpack(batch) end
      return batch
    end
  end

  -- DistributedSampler(dataset, {num_replicas =, rank =, shuffle = true, seed = 0, drop_last = false})
  -- (PyTorch's signature; dist.DistributedSampler(n, ...) is the same sampler)
  function D.DistributedSampler(ds, o)
    o = o or {}
    require("rpchost.errors").check_options(o, {"num_replicas", "world_size", "rank", "shuffle", "seed", "drop_last"},
      "DistributedSampler")
    local n = type(ds) == "number" and ds or len_of(ds)
    return require("rpchost.dist").DistributedSampler(n, {rank = o.rank, world_size = o.num_replicas or o.world_size,
      shuffle = o.shuffle, seed = o.seed, drop_last = o.drop_last})
  end
  -- a sized class, callable to make one: D[name](...) is new(...) as a sized object
  local function class(name, new)
    local cls = {name = name, __sized = true}
    cls.__index = cls
    D[name] = setmetatable(cls, {__call = function(_, ...) return sized.new(setmetatable(new(...), cls)) end})
    return cls
  end
  local function count_of(ds) return type(ds) == "number" and ds or len_of(ds) end

  -- RandomSampler(dataset or n, {seed =}): every index once, in random order
  local RandomSampler = class("RandomSampler", function(ds, o)
    o = o or {}
    return {n = count_of(ds), seed = o.seed}
  end)
  function RandomSampler:len() return self.n end
  function RandomSampler:indices()
    return self.seed and permutation(self.n, self.seed) or tensor.randperm(self.n):totable()
  end
  -- SequentialSampler(dataset or n): 1..n in order
  local SequentialSampler = class("SequentialSampler", function(ds) return {n = count_of(ds)} end)
  function SequentialSampler:len() return self.n end
  function SequentialSampler:indices()
    local t = {}
    for i = 1, self.n do t[i] = i end
    return t
  end

  -- Subset(dataset, ids): the items of dataset at ids, renumbered 1..#ids
  local Subset = class("Subset", function(ds, ids) return {dataset = ds, ids = ids} end)
  function Subset:len() return #self.ids end
  function Subset:get(i)
    local ds = self.dataset
    return getter(ds)(ds, self.ids[i])
  end

  function D.random_split(ds, lengths, o)
    o = o or {}
    local n = len_of(ds)
    local total = 0
    for _, l in ipairs(lengths) do total = total + l end
    if total ~= n then error("random_split: sum of input lengths does not equal the length of the input dataset", 2) end
    local perm = o.seed and permutation(n, o.seed) or tensor.randperm(n):totable()
    local out, pos = {}, 1
    for k, l in ipairs(lengths) do
      local ids = {}
      for i = pos, pos + l - 1 do ids[#ids + 1] = perm[i] end
      pos = pos + l
      out[k] = D.Subset(ds, ids)
    end
    return out
  end

  -- readers ---------------------------------------------------------------------------------
  local function read_file(path, what)
    if type(path) ~= "string" then error(what .. ": expected a file path", 3) end
    local f, err = io.open(path, "rb")
    if not f then error(what .. ": cannot open " .. path .. ": " .. tostring(err), 3) end
    local s = f:read("*a")
    f:close()
    if s:sub(1, 2) == "\31\139" then s = require("rpchost.zlib").inflate(s, "gzip") end
    return s
  end

  -- read_csv(path, {delimiter = ",", header = auto, skip_rows = 0, dtype =, columns =})
  -- -> a [rows, cols] tensor of numbers and the header's names (or nil). A
  -- gzipped file (by its magic bytes) is inflated first. header: true / false /
  -- nil (auto: a first line with a field that is not a number).
  function D.read_csv(path, o)
    o = o or {}
    local s = read_file(path, "read_csv")
    local delim = o.delimiter or ","
    local rows, names = {}, nil
    local lineno, ncols = 0, nil
    local skip = o.skip_rows or 0
    for line in s:gmatch("[^\r\n]+") do
      lineno = lineno + 1
      if lineno > skip and line:match("%S") then
        local fields = {}
        for f in (line .. delim):gmatch("(.-)" .. delim:gsub("%p", "%%%0")) do fields[#fields + 1] = f end
        local nums, bad = {}, nil
        for i, f in ipairs(fields) do
          local v = tonumber((f:gsub("^%s+", ""):gsub("%s+$", "")))
          if v == nil then
            local lf = f:lower():gsub("%s", "")
            if lf == "nan" then v = 0 / 0 elseif lf == "inf" then v = math.huge elseif lf == "-inf" then v = -math.huge end
          end
          if v == nil then bad = bad or i end
          nums[i] = v
        end
        if names == nil and #rows == 0 and (o.header == true or (o.header == nil and bad)) then
          names = {}
          for i, f in ipairs(fields) do names[i] = (f:gsub("^%s*\"?", ""):gsub("\"?%s*$", "")) end
        else
          if bad then
            error(("read_csv: %s line %d field %d (%q) is not a number"):format(path, lineno, bad, fields[bad]), 2)
          end
          ncols = ncols or #nums
          if #nums ~= ncols then
            error(("read_csv: %s line %d has %d fields, the first row had %d"):format(path, lineno, #nums, ncols), 2)
          end
          rows[#rows + 1] = nums
        end
      end
    end
    if #rows == 0 then
      return tensor.zeros(0, names and #names or 0, {dtype = o.dtype}), names
    end
    local t = tensor.tensor(rows, {dtype = o.dtype or tensor.get_default_dtype()})
    return t, names
  end

  -- load(path): a tensor from .npy, a table name -> tensor from .npz (both
  -- read straight into the tensors by nn.load); a gzipped .npy is inflated
  -- in memory first
  function D.load(path)
    local ser = require "rpchost.nn.serialize"
    if type(path) ~= "string" then error("data.load: expected a file path", 2) end
    local r = require("rpchost.atomic_file").reader(path, "data.load")
    local magic = r:read(0, math.min(r:size(), 2))
    r:close()
    if magic ~= "\31\139" then return ser.load(path) end
    local s = read_file(path, "data.load")
    if s:sub(1, 6) ~= "\147NUMPY" then error("data.load: " .. path .. " is gzipped, but not a .npy file", 2) end
    return ser.npy_parse(s, path)
  end
  D.load_npy = D.load
  D.load_npz = function(path) return require("rpchost.nn.serialize").load(path) end
end

return M
