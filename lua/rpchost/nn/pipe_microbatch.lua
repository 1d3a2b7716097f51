-- rpchost.nn.pipe_microbatch: how nn.Pipe cuts a mini-batch into micro-batches
-- and joins their outputs again (PyTorch's torch.distributed.pipeline.sync
-- .microbatch).
--
-- A micro-batch is one value or a tuple of values: a tensor, or a plain list
-- table {n = k, ...} (PyTorch's tuple). A stage's layers pass tuples on as
-- arguments: a layer gets unpack(tuple), and a layer that returns several
-- values (or one plain list table) hands the next one a tuple. Only tensors are
-- cut, along their first dimension, with tensor.chunk (so 10 rows in 4 chunks
-- are micro-batches of 3, 3, 3 and 1, and 6 rows in 4 chunks are 3 micro-batches
-- of 2, as torch.chunk gives); other values, and tensors wrapped in NoChunk, go
-- whole to every micro-batch. Gathering concatenates each tensor position along
-- the first dimension and collects other values into a list.
local tensor = require "rpchost.tensor"

local M = {}

local pack = table.pack or function(...) return {n = select("#", ...), ...} end
local is_tensor = tensor.is_tensor

-- NoChunk(t): a tensor every micro-batch gets whole (PyTorch's NoChunk)
local NoChunk = {name = "NoChunk"}
NoChunk.__index = NoChunk
NoChunk.__tostring = function(w) return "NoChunk(" .. tostring(w.tensor) .. ")" end
M.NoChunk = setmetatable(NoChunk, {__call = function(_, t)
  if not is_tensor(t) then
    error(("NoChunk: only a tensor can be wrapped, got %s"):format(type(t)), 2)
  end
  return setmetatable({tensor = t}, NoChunk)
end})
local function is_nochunk(v) return getmetatable(v) == NoChunk end

-- a tuple: a plain list table (no metatable: not a module, not an object)
local function is_tuple(v) return type(v) == "table" and getmetatable(v) == nil end
M.is_tuple = is_tuple
local function count(v) return v.n or #v end
M.count = count

-- describes a value for error messages
local function kind(v)
  if is_tensor(v) then return "tensor" end
  if is_tuple(v) then return "table" end
  return type(v)
end

-- scatter(inputs, chunks) -> list of micro-batches. inputs: the packed
-- arguments of pipe(...): one tensor gives tensors, several values tuples.
function M.scatter(inputs, chunks, what)
  what = what or "nn.Pipe"
  if inputs.n == 1 and is_tensor(inputs[1]) then return inputs[1]:chunk(chunks, 1) end
  local pieces, n = {}, nil
  for k = 1, inputs.n do
    local v = inputs[k]
    if is_tensor(v) then
      if v:dim() == 0 then
        error(("%s: input %d is a tensor with no dimensions: there is no batch dimension to cut (wrap it in " ..
          "nn.pipeline.NoChunk to give it to every micro-batch)"):format(what, k), 3)
      end
      pieces[k] = v:chunk(chunks, 1)
      if n and n ~= #pieces[k] then
        error(("%s: the inputs cut into different numbers of micro-batches (%d and %d): every tensor input " ..
          "needs the same batch size along its first dimension"):format(what, n, #pieces[k]), 3)
      end
      n = #pieces[k]
    end
  end
  if not n then
    local kinds = {}
    for k = 1, inputs.n do kinds[k] = is_nochunk(inputs[k]) and "NoChunk" or kind(inputs[k]) end
    error(("%s: the input has no tensor to cut into micro-batches (got %s)"):format(what,
      inputs.n == 0 and "nothing" or table.concat(kinds, ", ")), 3)
  end
  local out = {}
  for i = 1, n do
    local b = {n = inputs.n}
    for k = 1, inputs.n do
      local v = inputs[k]
      if pieces[k] then b[k] = pieces[k][i]
      elseif is_nochunk(v) then b[k] = v.tensor
      else b[k] = v end
    end
    out[i] = b
  end
  return out
end

-- the number of rows of a micro-batch (its first tensor's first dimension)
function M.rows(b)
  if is_tensor(b) then return b:size(1) end
  for k = 1, count(b) do
    if is_tensor(b[k]) and b[k]:dim() > 0 then return b[k]:size(1) end
  end
  return 1
end

-- gather(outputs) -> the mini-batch's output: the micro-batches' outputs
-- joined (tensors concatenated along the first dimension, other values in a
-- list per position)
function M.gather(outs, what)
  what = what or "nn.Pipe"
  local first = outs[1]
  if is_tensor(first) then
    for i = 2, #outs do
      if not is_tensor(outs[i]) then
        error(("%s: micro-batch 1 gave a tensor but micro-batch %d a %s"):format(what, i, kind(outs[i])), 3)
      end
    end
    if #outs == 1 then return first end
    return tensor.cat(outs, 1)
  end
  if not is_tuple(first) then
    error(("%s: the last stage gave a %s: a stage must give a tensor or a table of values with at least one " ..
      "tensor"):format(what, type(first)), 3)
  end
  local n = count(first)
  local out = {n = n}
  for k = 1, n do
    local col = {}
    for i, b in ipairs(outs) do
      if not is_tuple(b) or kind(b[k]) ~= kind(first[k]) then
        error(("%s: the outputs of micro-batches 1 and %d differ at position %d (%s and %s)"):format(what, i, k,
          kind(first[k]), is_tuple(b) and kind(b[k]) or kind(b)), 3)
      end
      col[i] = b[k]
    end
    if is_tensor(first[k]) then out[k] = #col == 1 and col[1] or tensor.cat(col, 1) else out[k] = col end
  end
  return out
end

-- each tensor of a value, with its position (1 for a lone tensor)
local function each_tensor(v, fn)
  if is_tensor(v) then return fn(v, 1) end
  if is_tuple(v) then
    for k = 1, count(v) do
      if is_tensor(v[k]) then fn(v[k], k) end
    end
  end
end
M.each_tensor = each_tensor

-- map(v, fn): the value with each tensor t replaced by fn(t)
local function map(v, fn)
  if is_tensor(v) then return fn(v) end
  if not is_tuple(v) then return v end
  local out = {n = count(v)}
  for k = 1, out.n do
    local x = v[k]
    if is_tensor(x) then out[k] = fn(x) else out[k] = x end
  end
  return out
end
M.map = map

local function is_float(t) return t.dtype == tensor.float32 or t.dtype == tensor.float64 end

-- the value cut from the graph that made it; with leaf, its float tensors
-- become leaves that require grad (a stage's input, whose gradient the stage's
-- backward gives back)
function M.detached(v, leaf)
  return map(v, function(t)
    local d = t:detach()
    if leaf and is_float(t) then d.requires_grad = true end
    return d
  end)
end

-- the value on a device (autograd records the moves)
function M.to_device(v, device)
  return map(v, function(t)
    if t.device == device then return t end
    return t:to(device)
  end)
end

-- unpack a value into arguments, and pack results into a value
function M.args(v)
  if is_tuple(v) then return unpack(v, 1, count(v)) end
  return v
end
function M.value(...)
  local r = pack(...)
  if r.n == 1 then return r[1] end
  return r
end

return M
