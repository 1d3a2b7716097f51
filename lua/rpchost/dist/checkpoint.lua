-- rpchost.dist.checkpoint: a world's checkpoint, in the spirit of PyTorch's
-- torch.distributed.checkpoint (docs/dist.md, "Checkpoints").
--
-- save(state_dict, dir): every rank writes the tensors it is to write into a
-- data file of its own, named by this save's generation ("__<rank>_<gen>.distcp"),
-- each file complete before it takes its name; then, once every rank's file is
-- there, rank 0 writes ".metadata" (what each key is, and which file holds each
-- piece of it), which takes its name last. A directory's checkpoint is the one
-- its .metadata names: a save killed at any point leaves the previous one, whose
-- files a new save never overwrites (another generation) and removes only after
-- its own .metadata is in place. Every file is written by rpchost.atomic_file:
-- straight from the tensors' storage, checked, synced, renamed into place.
--
-- What a rank writes: a tensor every rank holds (a DDP replica) once in the
-- world, the ranks taking the keys in turn; a shard (checkpoint.Shard: this
-- rank's piece of a larger tensor, ZeRO's optimizer state) by its owner; other
-- values (numbers, strings, booleans) in the metadata. Nested tables are keys
-- joined with ".". load(state_dict, dir) fills state_dict in place: each tensor
-- (or shard) from the pieces that overlap it, so a checkpoint saved by one world
-- size loads into another.
local core = require "rpchost.core"
local errors = require "rpchost.errors"
local codec = require "rpchost.wire.codec"
local dist = require "rpchost.dist"
local tensor = require "rpchost.tensor"
local atomic_file = require "rpchost.atomic_file"

local M = {}

local MAGIC, VERSION = "rpchost-dcp", 1

local function cfg(msg, ...) error(errors.new("config", msg:format(...)), 0) end

-- Shard{tensor =, offsets = {...}, size = {...}}: this rank's piece of a
-- tensor of `size`, starting at `offsets` (0-based, one per dimension).
local Shard = {}
Shard.__index = Shard
Shard.__tostring = function(s)
  return ("Shard(offsets {%s} of {%s})"):format(table.concat(s.offsets, ", "), table.concat(s.size, ", "))
end
M.Shard = setmetatable({}, {__call = function(_, o)
  if type(o) ~= "table" or not tensor.is_tensor(o.tensor) then
    cfg("checkpoint.Shard: expected {tensor =, offsets =, size =}, got %s", type(o))
  end
  local dims = o.tensor:dim()
  if type(o.offsets) ~= "table" or #o.offsets ~= dims or type(o.size) ~= "table" or #o.size ~= dims then
    cfg("checkpoint.Shard: offsets and size must list one number per dimension of the tensor (%d)", dims)
  end
  local local_size = o.tensor:size()
  for d = 1, dims do
    if o.offsets[d] < 0 or o.offsets[d] + local_size[d] > o.size[d] then
      cfg("checkpoint.Shard: the piece [%d, %d) of dimension %d does not fit its size %d", o.offsets[d],
        o.offsets[d] + local_size[d], d, o.size[d])
    end
  end
  return setmetatable({tensor = o.tensor, offsets = o.offsets, size = o.size}, Shard)
end})
function M.is_shard(v) return getmetatable(v) == Shard end

-- key path -> value, for every leaf of a nested state_dict (keys joined by ".")
local function flatten(sd, prefix, out)
  out = out or {}
  for k, v in pairs(sd) do
    local key = prefix and (prefix .. "." .. tostring(k)) or tostring(k)
    if type(k) ~= "string" and type(k) ~= "number" then
      cfg("checkpoint: state_dict keys must be strings or numbers, got a %s under %s", type(k), prefix or "the top")
    end
    if type(v) == "table" and getmetatable(v) == nil then flatten(v, key, out)
    else out[key] = v end
  end
  return out
end

-- the (possibly nested) table and last key a flattened path names in sd
local function place(sd, path)
  local t, last = sd, nil
  for part in path:gmatch("[^.]+") do
    if last ~= nil then
      local k = t[last] ~= nil and last or tonumber(last)
      if t[k] == nil then t[k] = {} end
      t = t[k]
    end
    last = part
  end
  if t[last] == nil and tonumber(last) and t[tonumber(last)] ~= nil then last = tonumber(last) end
  return t, last
end

local function dtype_of(t) return (tostring(t.dtype):gsub("^tensor%.", "")) end
-- a Size as a plain list (what the metadata holds)
local function list(size) return {unpack(size)} end

local function host_contiguous(t)
  if t.device ~= "cpu" then t = t:cpu() end
  return core.t_is_contiguous(t) and t or t:contiguous()
end

local function group_size() return dist.get_world_size(), dist.get_rank() end

-- Writes `pieces` (tensors, in order) into path, atomically (rpchost.atomic_file:
-- a temporary file, every write checked, synced, renamed over path, the
-- directory synced; straight from the tensors' storage); returns each piece's
-- byte offset.
local function write_data(path, pieces)
  local size = 0
  for _, t in ipairs(pieces) do size = size + t:numel() * t:element_size() end
  local offsets = {}
  atomic_file.save(path, function(f)
    for i, t in ipairs(pieces) do
      offsets[i] = f:offset()
      f:write_tensor(t)
    end
  end, {size = size, who = "checkpoint.save"})
  return offsets
end

local function list_dir(dir)
  local names = {}
  local p = io.popen(("ls -a %q 2>/dev/null"):format(dir))
  if p then
    for name in p:lines() do names[#names + 1] = name end
    p:close()
  end
  return names
end

-- save(state_dict, dir [, {group? no: the world}])
function M.save(sd, dir)
  if type(sd) ~= "table" then cfg("checkpoint.save: state_dict must be a table, got %s", type(sd)) end
  if type(dir) ~= "string" then cfg("checkpoint.save: dir must be a path, got %s", type(dir)) end
  if not dist.is_initialized() then
    cfg("checkpoint.save: the process group is not initialised (dist.init_process_group first)")
  end
  local n, rank = group_size()
  os.execute(("mkdir -p %q"):format(dir))
  -- this save's generation: rank 0's, the same everywhere
  local gen = {rank == 0 and ("%x%x"):format(os.time(), math.random(0, 0x7fffffff)) or false}
  dist.broadcast_object_list(gen, 0)
  gen = gen[1]
  local flat = flatten(sd)
  local keys = {}
  for k in pairs(flat) do keys[#keys + 1] = k end
  table.sort(keys)
  -- what this rank writes, and what it says of every key it knows
  local mine, items, plain = {}, {}, {}
  local turn = 0
  for _, k in ipairs(keys) do
    local v = flat[k]
    if M.is_shard(v) then
      mine[#mine + 1] = v.tensor
      items[#items + 1] = {key = k, kind = "shard", dtype = dtype_of(v.tensor), size = list(v.size),
                           offsets = list(v.offsets), local_size = list(v.tensor:size()), piece = #mine}
    elseif tensor.is_tensor(v) then
      turn = turn + 1
      if (turn - 1) % n == rank then
        mine[#mine + 1] = v
        items[#items + 1] = {key = k, kind = "tensor", dtype = dtype_of(v), size = list(v:size()), piece = #mine}
      end
    elseif type(v) == "number" or type(v) == "string" or type(v) == "boolean" then
      if rank == 0 then plain[k] = v end
    else
      cfg("checkpoint.save: %s is a %s; a state_dict holds tensors, shards, numbers, strings and booleans", k, type(v))
    end
  end
  local file = ("__%d_%s.distcp"):format(rank, gen)
  local ok, offsets = pcall(write_data, dir .. "/" .. file, mine)
  -- (every rank learns whether every file is in place before rank 0 commits)
  local report = {file = file, ok = ok, err = not ok and tostring(errors.is(offsets) and offsets.message or offsets) or nil,
                  items = items}
  if ok then
    for _, it in ipairs(items) do it.offset = offsets[it.piece]; it.piece = nil end
  end
  local all = {}
  dist.all_gather_object(all, report)
  for r, rep in ipairs(all) do
    if not rep.ok then
      if not ok then error(offsets, 0) end
      cfg("checkpoint.save: rank %d could not write its part (%s); the previous checkpoint in %s stays", r - 1,
        tostring(rep.err), dir)
    end
  end
  if rank == 0 then
    local meta = {magic = MAGIC, version = VERSION, world_size = n, plain = plain, entries = {}}
    for _, rep in ipairs(all) do
      for _, it in ipairs(rep.items) do
        it.file = rep.file
        local e = meta.entries[it.key]
        if not e then
          e = {kind = it.kind, dtype = it.dtype, size = it.size, pieces = {}}
          meta.entries[it.key] = e
        end
        e.pieces[#e.pieces + 1] = {file = it.file, offset = it.offset, offsets = it.offsets, local_size = it.local_size}
      end
    end
    -- the commit: .metadata takes its name last (durably: atomic_file)
    atomic_file.save(dir .. "/.metadata", codec.encode("dcp", meta), {who = "checkpoint.save"})
  end
  -- the previous generation's files (and what a killed save left) go, once
  -- the new .metadata is in place; the others return when that is done
  if rank == 0 then
    for _, name in ipairs(list_dir(dir)) do
      local g = name:match("^__%d+_(%x+)%.distcp$") or name:match("^%.__%d+_(%x+)%.distcp%.tmp%-")
      if g and g ~= gen then os.remove(dir .. "/" .. name) end
    end
  end
  dist.barrier()
end

local function read_file(path)
  local r = atomic_file.reader(path, "checkpoint.load")
  local s = r:read(0, r:size())
  r:close()
  return s
end

local function read_meta(dir)
  local raw = read_file(dir .. "/.metadata")
  local ok, meta = pcall(codec.decode, raw)
  if not ok or type(meta) ~= "table" or meta.magic ~= MAGIC then
    cfg("checkpoint.load: %s/.metadata is not an rpchost checkpoint's (damaged, or another format)", dir)
  end
  if meta.version ~= VERSION then
    cfg("checkpoint.load: %s was written by checkpoint format %s; this rpchost reads format %d", dir,
      tostring(meta.version), VERSION)
  end
  return meta
end

local DTYPES = {float32 = tensor.float32, float64 = tensor.float64, int32 = tensor.int32, int64 = tensor.int64,
                uint8 = tensor.uint8, bool = tensor.bool}

-- a saved piece as a tensor, read straight from its file at its offset
local readers = nil
local function piece_tensor(dir, e, p)
  local dt = DTYPES[e.dtype] or cfg("checkpoint.load: unknown dtype %s", tostring(e.dtype))
  local r = readers[p.file]
  if not r then
    r = atomic_file.reader(dir .. "/" .. p.file, "checkpoint.load")
    readers[p.file] = r
  end
  return (r:read_tensor(p.offset, dt.id, p.local_size or e.size))
end

-- Copies into `target` (a tensor that is the region at `toff` of the whole)
-- every saved piece's overlap with it.
local function fill(dir, e, target, toff, key)
  local tsize = target:size()
  local covered = 0
  for _, p in ipairs(e.pieces) do
    local poff = p.offsets or {}
    local psize = p.local_size or e.size
    local lo, len = {}, {}
    local empty = false
    for d = 1, #tsize do
      local a = math.max(toff[d] or 0, poff[d] or 0)
      local b = math.min((toff[d] or 0) + tsize[d], (poff[d] or 0) + psize[d])
      if b <= a then empty = true break end
      lo[d], len[d] = a, b - a
    end
    if not empty then
      local src = piece_tensor(dir, e, p)
      local dst = target
      local n = 1
      for d = 1, #tsize do
        src = src:narrow(d, lo[d] - (poff[d] or 0) + 1, len[d])
        dst = dst:narrow(d, lo[d] - (toff[d] or 0) + 1, len[d])
        n = n * len[d]
      end
      tensor.no_grad(function() dst:copy_(src) end)
      covered = covered + n
    end
  end
  if covered < target:numel() then
    cfg("checkpoint.load: %s: the checkpoint holds %d of the %d elements asked for", key, covered, target:numel())
  end
end

-- load(state_dict, dir): fills state_dict in place
function M.load(sd, dir)
  if type(sd) ~= "table" then cfg("checkpoint.load: state_dict must be a table, got %s", type(sd)) end
  local meta = read_meta(dir)
  readers = {}
  local ok, err = pcall(function()
    local flat = flatten(sd)
    for k, v in pairs(flat) do
      local e = meta.entries[k]
      if M.is_shard(v) then
        if not e then cfg("checkpoint.load: %s is not in the checkpoint in %s", k, dir) end
        fill(dir, e, v.tensor, v.offsets, k)
      elseif tensor.is_tensor(v) then
        if not e then cfg("checkpoint.load: %s is not in the checkpoint in %s", k, dir) end
        local same = #e.size == v:dim()
        for d = 1, #e.size do same = same and e.size[d] == v:size()[d] end
        if not same then
          cfg("checkpoint.load: %s has shape [%s] in the checkpoint but [%s] here", k, table.concat(e.size, ", "),
            table.concat(list(v:size()), ", "))
        end
        fill(dir, e, v, {}, k)
      elseif meta.plain[k] ~= nil then
        local t, last = place(sd, k)
        t[last] = meta.plain[k]
      end
    end
    -- values the state_dict does not have yet (numbers, strings) come too
    for k, v in pairs(meta.plain) do
      if flat[k] == nil then
        local t, last = place(sd, k)
        t[last] = v
      end
    end
  end)
  for _, r in pairs(readers) do r:close() end
  readers = nil
  if not ok then error(err, 0) end
  return sd
end

-- PyTorch 1.13's names: save_state_dict(sd, FileSystemWriter(dir)),
-- load_state_dict(sd, FileSystemReader(dir))
function M.FileSystemWriter(dir) return {path = dir} end
function M.FileSystemReader(dir) return {path = dir} end
function M.save_state_dict(sd, writer) return M.save(sd, type(writer) == "table" and writer.path or writer) end
function M.load_state_dict(sd, reader) return M.load(sd, type(reader) == "table" and reader.path or reader) end

return M
