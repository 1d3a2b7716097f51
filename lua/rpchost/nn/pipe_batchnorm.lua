-- rpchost.nn.pipe_batchnorm: DeferredBatchNorm, nn.Pipe's deferred_batch_norm
-- option (PyTorch's torch.distributed.pipeline.sync.batchnorm).
--
-- A BatchNorm inside a pipeline sees micro-batches: it normalises each with
-- that micro-batch's statistics (as it must: the others are not there yet),
-- but updating the running statistics once per micro-batch would weigh the
-- mini-batch M times over. DeferredBatchNorm normalises as BatchNorm does in
-- training and only accumulates the micro-batches' sums; after the last
-- micro-batch of a mini-batch it updates running_mean and running_var once,
-- from the whole mini-batch's mean and (unbiased, as BatchNorm's) variance: the
-- running statistics a BatchNorm run on the whole mini-batch would keep.
-- A checkpointed micro-batch runs its forward again in backward; that second
-- run is not counted (M.recomputing says when one is running).
local tensor = require "rpchost.tensor"
local mod = require "rpchost.nn.module"
local F = require "rpchost.nn.functional"

local M = {}

-- true while a checkpointed stage runs its forward again in backward
local recomputing = false
function M.is_recomputing() return recomputing end

-- runs fn(...) as a recomputation (also when fn raises)
function M.recompute(fn, ...)
  local outer = recomputing
  recomputing = true
  local res = table.pack(pcall(fn, ...))
  recomputing = outer
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, res.n)
end

local DBN = mod.Module:extend("DeferredBatchNorm")
M.DeferredBatchNorm = DBN

-- DeferredBatchNorm(num_features, {eps =, momentum =, affine =, chunks =})
function DBN:__init(n, o)
  o = o or {}
  self.num_features, self.eps = n, o.eps or 1e-5
  self.momentum = o.momentum
  if self.momentum == nil then self.momentum = 0.1 end
  self.affine = o.affine ~= false
  self.chunks = o.chunks or 1
  local dt = {dtype = o.dtype or tensor.get_default_dtype()}
  if self.affine then
    self:register_parameter("weight", tensor.ones(n, dt))
    self:register_parameter("bias", tensor.zeros(n, dt))
  end
  self:register_buffer("running_mean", tensor.zeros(n, dt))
  self:register_buffer("running_var", tensor.ones(n, dt))
  self:register_buffer("num_batches_tracked", tensor.zeros({}, {dtype = tensor.int64}))
  self:register_buffer("sum", tensor.zeros(n, dt))
  self:register_buffer("sum_squares", tensor.zeros(n, dt))
  self.counter, self.tracked = 0, 0
end

-- x as [C, everything else]
local function by_channel(x)
  return x:transpose(1, 2):reshape(x:size(2), -1)
end

-- adds a micro-batch's sums
function DBN:_track(x)
  tensor.no_grad(function()
    local v = by_channel(x:detach())
    self.sum:add_(v:sum(2))
    self.sum_squares:add_((v * v):sum(2))
  end)
  self.counter = self.counter + x:numel() / x:size(2)
  self.tracked = self.tracked + 1
end

-- updates the running statistics from the micro-batches tracked so far
function DBN:_commit()
  if self.tracked == 0 then return end
  tensor.no_grad(function()
    self.num_batches_tracked:add_(1LL)
    local m = self.momentum
    if m == false then m = 1 / self.num_batches_tracked:item() end
    local n = self.counter
    local mean = self.sum / n
    local var = self.sum_squares / n - mean * mean
    if n > 1 then var = var * (n / (n - 1)) end
    self.running_mean:mul_(1 - m):add_(mean * m)
    self.running_var:mul_(1 - m):add_(var * m)
    self.sum:zero_()
    self.sum_squares:zero_()
  end)
  self.counter, self.tracked = 0, 0
end

function DBN:forward(x)
  if not tensor.is_tensor(x) or x:dim() < 2 or x:size(2) ~= self.num_features then
    self:shape_error(("[N, %d, ...]"):format(self.num_features), x)
  end
  if not self.training then
    return F.batch_norm(x, self.running_mean, self.running_var, {weight = self.weight, bias = self.bias,
      training = false, momentum = 0, eps = self.eps})
  end
  if not recomputing then
    self:_track(x)
    if self.tracked >= self.chunks then self:_commit() end
  end
  return F.batch_norm(x, nil, nil, {weight = self.weight, bias = self.bias, training = true, momentum = 0,
    eps = self.eps})
end

function DBN:extra_repr()
  return ("%d, eps=%s, momentum=%s, chunks=%d"):format(self.num_features, tostring(self.eps),
    tostring(self.momentum), self.chunks)
end

local function is_batchnorm(m)
  local name = getmetatable(m) and getmetatable(m).name
  return (name == "BatchNorm1d" or name == "BatchNorm2d") and m.track_running_stats
end

-- a BatchNorm's DeferredBatchNorm, sharing its parameters and buffers
local function deferred_of(bn, chunks)
  local d = DBN(bn.num_features, {eps = bn.eps, momentum = bn.cumulative and false or bn.momentum,
    affine = bn.affine, chunks = chunks, dtype = bn.running_mean.dtype})
  if bn.affine then
    d.weight, d.bias = bn.weight, bn.bias
  end
  d.running_mean, d.running_var = bn.running_mean, bn.running_var
  d.num_batches_tracked = bn.num_batches_tracked
  d.training = bn.training
  return d
end

-- convert(module, chunks): module with every BatchNorm in it (itself included)
-- replaced by a DeferredBatchNorm that shares its parameters and buffers
-- (PyTorch's DeferredBatchNorm.convert_deferred_batch_norm); the containers are
-- changed in place
function M.convert(m, chunks)
  if getmetatable(m) == DBN then
    m.chunks = chunks
    return m
  end
  if is_batchnorm(m) then return deferred_of(m, chunks) end
  for _, c in ipairs(m:named_children()) do
    local new = M.convert(c[2], chunks)
    if new ~= c[2] then m._modules[c[1]] = new end
  end
  return m
end

-- commits what every DeferredBatchNorm in the layers tracked (the end of a
-- mini-batch that had fewer micro-batches than chunks)
function M.commit_all(layers)
  for _, l in ipairs(layers) do
    for _, nm in ipairs(l:named_modules()) do
      if getmetatable(nm[2]) == DBN then nm[2]:_commit() end
    end
  end
end

return M
