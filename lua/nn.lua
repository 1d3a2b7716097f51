-- nn: modules for building models (PyTorch's torch.nn). The pieces live in
-- lua/rpchost/nn/ by family: module.lua (nn.Module: registries, state_dict,
-- train/eval, to/cuda), layers.lua (Linear, Conv, pooling, normalisation,
-- embeddings, containers), rnn.lua (RNN, LSTM, GRU), attention.lua
-- (MultiheadAttention, TransformerEncoderLayer), loss.lua, functional.lua
-- (nn.functional), init.lua (nn.init), utils.lua (nn.utils), serialize.lua
-- (nn.save/nn.load: PyTorch's .pt files and .npz archives numpy reads) and pipe.lua (nn.Pipe). Every class is a field of this
-- module, so modules travel over RPC by name with their parameters.
local mod = require "rpchost.nn.module"

local nn = {}

nn.Module = mod.Module
nn.Parameter = mod.Parameter
nn.is_module = mod.is_module
nn.deepcopy = mod.deepcopy
for _, family in ipairs{"rpchost.nn.layers", "rpchost.nn.rnn", "rpchost.nn.attention", "rpchost.nn.loss"} do
  for k, v in pairs(require(family)) do nn[k] = v end
end
nn.functional = require "rpchost.nn.functional"
nn.F = nn.functional
nn.init = require "rpchost.nn.init"
nn.utils = require "rpchost.nn.utils"
local io_ = require "rpchost.nn.serialize"
nn.save, nn.load, nn.save_npz, nn.load_npz = io_.save, io_.load, io_.save_npz, io_.load_npz

-- DistributedDataParallel lives with dist (it needs the process group)
nn.DistributedDataParallel = function(...) return require("rpchost.nn.ddp").new(...) end

-- pipeline parallelism (PyTorch's torch.distributed.pipeline.sync): nn.Pipe,
-- and beside it in nn.pipeline the balance helpers, DeferredBatchNorm and
-- NoChunk (docs/pipeline.md)
local pipe = require "rpchost.nn.pipe"
local balance = require "rpchost.nn.pipe_balance"
nn.Pipe = pipe.Pipe
nn.pipeline = {Pipe = pipe.Pipe, balance_by_time = balance.balance_by_time,
               balance_by_size = balance.balance_by_size,
               DeferredBatchNorm = require("rpchost.nn.pipe_batchnorm").DeferredBatchNorm,
               NoChunk = require("rpchost.nn.pipe_microbatch").NoChunk,
               bubble = require("rpchost.nn.pipe_schedule").bubble}
nn.parallel = {DistributedDataParallel = nn.DistributedDataParallel, Pipe = pipe.Pipe}

return nn
