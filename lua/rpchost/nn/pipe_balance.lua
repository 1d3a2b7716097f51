-- rpchost.nn.pipe_balance: balance_by_time and balance_by_size, the helpers
-- torchgpipe had (and PyTorch keeps in torch.distributed.pipeline.sync._balance)
-- to choose nn.Pipe's balance: each layer of the Sequential is measured alone,
-- then the list of costs is cut into contiguous blocks of even cost.
--
-- The cut is "Block Partitions of Sequences" (Bárány and Grinberg,
-- arXiv:1308.2452), as torchgpipe's blockpartition.solve runs it: start from
-- blocks of even length and move one element at a time from a heaviest block
-- towards a lightest until the heaviest is at most the lightest plus the
-- largest single cost (the costs are normalised to [0, 1]).
local tensor = require "rpchost.tensor"
local autograd = require "rpchost.autograd.engine"
local mod = require "rpchost.nn.module"
local core = require "rpchost.core"

local M = {}

-- solve(costs, k) -> list of k block lengths (contiguous, in order)
function M.solve(costs, k)
  if type(k) ~= "number" or k < 1 or k % 1 ~= 0 then
    error(("balance: partitions must be a positive integer, got %s"):format(tostring(k)), 3)
  end
  local n = #costs
  if n < k then
    error(("balance: the Sequential has %d layers, fewer than the %d partitions asked for"):format(n, k), 3)
  end
  local lo, hi = math.huge, -math.huge
  for _, c in ipairs(costs) do lo, hi = math.min(lo, c), math.max(hi, c) end
  local span = hi - lo
  local norm = {}
  for i, c in ipairs(costs) do norm[i] = span == 0 and 0 or (c - lo) / span end
  -- splits[b] (b = 0 .. k-1) is where block b ends (exclusive, 0-based), as torchgpipe's list
  local splits = {}
  for b = 0, k - 2 do splits[b] = math.floor(n / k) * (b + 1) end
  splits[k - 1] = n
  local function size(b)
    local s = 0
    for i = (b > 0 and splits[b - 1] or 0) + 1, splits[b] do s = s + norm[i] end
    return s
  end
  -- the heaviest block (ties: the last one) and the lightest (ties: the first), as Python's max and min of
  -- (size, index) tuples pick them
  local function heaviest()
    local best, at = -math.huge, nil
    for b = 0, k - 1 do
      local s = size(b)
      if s >= best then best, at = s, b end
    end
    return best, at
  end
  local function lightest()
    local best, at = math.huge, nil
    for b = 0, k - 1 do
      local s = size(b)
      if s < best then best, at = s, b end
    end
    return best, at
  end
  while true do
    local max_size, p = heaviest()
    while true do
      local min_size, q = lightest()
      if max_size <= min_size + 1 then
        local out, prev = {}, 0
        for b = 0, k - 1 do
          out[b + 1] = splits[b] - prev
          prev = splits[b]
        end
        return out
      end
      local h
      if p < q then
        h = q - 1
        splits[h] = splits[h] - 1
      else
        h = q + 1
        splits[q] = splits[q] + 1
      end
      if p == h then break end
    end
  end
end

local function layers_of(seq, what)
  if not mod.is_module(seq) or type(seq.children) ~= "function" then
    error(("%s: expected an nn.Sequential, got %s"):format(what, type(seq)), 3)
  end
  return seq:children()
end

local function apply(layer, v)
  if type(v) == "table" and getmetatable(v) == nil then return layer(unpack(v, 1, v.n or #v)) end
  return layer(v)
end

-- a copy of v cut from any graph, each tensor requiring grad as the original did
local function detach(v)
  if tensor.is_tensor(v) then
    local d = v:detach()
    if v.requires_grad then d.requires_grad = true end
    return d
  end
  if type(v) == "table" and getmetatable(v) == nil then
    local out = {n = v.n or #v}
    for k = 1, out.n do out[k] = detach(v[k]) end
    return out
  end
  return v
end

-- backward from every tensor of v that requires grad, with itself as the gradient
local function backward_all(v)
  local roots = {}
  if tensor.is_tensor(v) then roots[1] = v
  elseif type(v) == "table" then
    for k = 1, v.n or #v do if tensor.is_tensor(v[k]) then roots[#roots + 1] = v[k] end end
  end
  local rs, gs = {}, {}
  for _, t in ipairs(roots) do
    if t.requires_grad then rs[#rs + 1], gs[#gs + 1] = t, t:detach() end
  end
  if #rs > 0 then autograd._backward_many(rs, gs, false) end
end

-- profile_times(seq, sample, timeout) -> microseconds per layer, forward and backward,
-- summed over as many rounds as fit in timeout seconds (each layer a copy in training mode)
function M.profile_times(seq, sample, timeout)
  local layers = layers_of(seq, "balance_by_time")
  for _, p in ipairs(seq:parameters()) do
    if p.grad ~= nil then error("balance_by_time: some parameter already has a gradient (zero_grad first)", 3) end
  end
  local copies = {}
  for i, l in ipairs(layers) do
    copies[i] = mod.deepcopy(l)
    copies[i]:train()
  end
  local times = {}
  for i = 1, #layers do times[i] = 0 end
  local begun = core.now()
  repeat
    local v = sample
    for i, l in ipairs(copies) do
      v = detach(v)
      local t0 = core.now()
      v = apply(l, v)
      backward_all(v)
      times[i] = times[i] + (core.now() - t0)
    end
  until core.now() - begun >= timeout
  for i = 1, #times do times[i] = math.floor(times[i] * 1e6) end
  return times
end

-- profile_sizes(seq, input, chunks, param_scale) -> bytes per layer: the
-- activations one micro-batch's forward keeps (live tensor bytes, measured on
-- one row and scaled to batch / chunks rows) plus param_scale times the layer's
-- parameter bytes
function M.profile_sizes(seq, input, chunks, param_scale)
  local layers = layers_of(seq, "balance_by_size")
  local rows
  local function first_row(t)
    rows = rows or t:size(1)
    local d = t:narrow(1, 1, 1):detach():clone()
    if t.requires_grad then d.requires_grad = true end
    return d
  end
  local v
  if tensor.is_tensor(input) then v = first_row(input)
  else
    v = {n = input.n or #input}
    for k = 1, v.n do v[k] = tensor.is_tensor(input[k]) and first_row(input[k]) or input[k] end
  end
  if not rows then error("balance_by_size: the input has no tensor", 3) end
  local latent_scale = rows / chunks
  local sizes = {}
  collectgarbage()
  for i, l in ipairs(layers) do
    local c = mod.deepcopy(l)
    c:train()
    v = detach(v)
    local before = tensor.live_bytes()
    v = apply(c, v)
    local latent = tensor.live_bytes() - before
    local params = 0
    for _, p in ipairs(c:parameters()) do params = params + p:numel() * p:element_size() end
    sizes[i] = math.floor(latent * latent_scale + params * param_scale)
  end
  return sizes
end

-- balance_by_time(partitions, seq, sample, {timeout = 1}) -> balance
function M.balance_by_time(partitions, seq, sample, o)
  o = o or {}
  return M.solve(M.profile_times(seq, sample, o.timeout or 1.0), partitions)
end

-- balance_by_size(partitions, seq, input, {chunks = 1, param_scale = 2}) -> balance
function M.balance_by_size(partitions, seq, input, o)
  o = o or {}
  return M.solve(M.profile_sizes(seq, input, o.chunks or 1, o.param_scale or 2.0), partitions)
end

return M
