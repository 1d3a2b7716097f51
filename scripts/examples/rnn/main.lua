-- examples/rnn/main.lua: pytorch/examples distributed/rpc/rnn (main.py and rnn.py), in rpchost.
--   rpchost run --nproc-per-node 2 scripts/examples/rnn/main.lua [--epochs 200]
-- Rank 0 is the parameter server "ps", rank 1 the trainer. The trainer's
-- RNNModel keeps the LSTM and puts the embedding table and the decoder on the
-- server (as RemoteModules); its forward looks tokens up remotely, runs the
-- LSTM, and decodes remotely. dist_autograd carries the gradients to both
-- workers and a DistributedOptimizer over all the parameter RRefs steps them.
-- The tutorial's batches are uninitialised LongTensors modulo the sizes, and
-- its loss takes the LSTM's batch dim as classes; here the batches are fixed
-- sequences (computed the same way in the twin, bench/tutorials/rnn.py) and
-- the loss is word_language_model's: each position predicts the next token,
-- so the loss can be seen to fall.
local here = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = here .. "/../common/?.lua;" .. package.path
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local dist_autograd = require "dist_autograd"

local epochs = require("args").parse("rnn", {epochs = 200}).epochs
local quiet = os.getenv("QUIET") ~= nil

-- on the server: the encoding table with its dropout
EmbeddingTable = nn.Module:extend("EmbeddingTable")
function EmbeddingTable:init(ntoken, ninp, dropout)
  self.drop = nn.Dropout(dropout)
  self.encoder = nn.Embedding(ntoken, ninp)
  nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
end
function EmbeddingTable:forward(input) return self.drop(self.encoder(input)) end

-- on the server: the decoder
Decoder = nn.Module:extend("Decoder")
function Decoder:init(ntoken, nhid, dropout)
  self.drop = nn.Dropout(dropout)
  self.decoder = nn.Linear(nhid, ntoken)
  tensor.no_grad(function()
    nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
    self.decoder.bias:zero_()
  end)
end
function Decoder:forward(output) return self.decoder(self.drop(output)) end

-- on the trainer: embedding (remote) -> LSTM (local) -> decoder (remote)
RNNModel = nn.Module:extend("RNNModel")
function RNNModel:init(ps, ntoken, ninp, nhid, nlayers, dropout)
  dropout = dropout or 0.5
  self.emb_table = rpc.RemoteModule(ps, EmbeddingTable, {ntoken, ninp, dropout})
  self.rnn = nn.LSTM(ninp, nhid, {num_layers = nlayers, dropout = dropout})
  self.decoder = rpc.RemoteModule(ps, Decoder, {ntoken, nhid, dropout})
end
function RNNModel:forward(input, hidden)
  local emb = self.emb_table:forward(input)
  local output
  output, hidden = self.rnn(emb, hidden)
  local decoded = self.decoder:forward(output)
  return decoded, hidden
end
function RNNModel:parameter_rrefs()
  local remote_params = {}
  for _, r in ipairs(self.emb_table:remote_parameters()) do remote_params[#remote_params + 1] = r end
  for _, p in ipairs(self.rnn:parameters()) do remote_params[#remote_params + 1] = rpc.RRef(p) end
  for _, r in ipairs(self.decoder:remote_parameters()) do remote_params[#remote_params + 1] = r end
  return remote_params
end

local function run_trainer()
  -- (the tutorial's 4 layers of 3 units with dropout 0.5 and lr 0.05 did not learn
  -- in 100 epochs of these batches: 2 layers of 16 units, no dropout, lr 0.5)
  local batch, ntoken, ninp, nhid, nindices, nlayers = 5, 7, 8, 16, 6, 2
  tensor.manual_seed(0)
  local hidden = {tensor.randn(nlayers, nindices, nhid), tensor.randn(nlayers, nindices, nhid)}
  local model = RNNModel("ps", ntoken, ninp, nhid, nlayers, 0)
  local opt = rpc.DistributedOptimizer(optim.SGD, model:parameter_rrefs(), {lr = 0.5})
  local criterion = nn.CrossEntropyLoss()
  -- five fixed batches: token (b, i) of batch k is (31 b + 17 i + 13 k) mod ntoken
  -- (b runs along the sequence), its target the next token, (31 (b + 1) + ...)
  -- (tokens are 1-based, Lua indices)
  local batches = {}
  for k = 1, 5 do
    local d, t = {}, {}
    for b = 1, batch do
      d[b], t[b] = {}, {}
      for i = 1, nindices do d[b][i] = (31 * b + 17 * i + 13 * k) % ntoken + 1 end
      for i = 1, nindices do t[b][i] = (31 * (b + 1) + 17 * i + 13 * k) % ntoken + 1 end
    end
    batches[k] = {tensor.tensor(d, {dtype = tensor.int64}), tensor.tensor(t, {dtype = tensor.int64})}
  end
  local t0, first, last = rpc.time(), nil, nil
  for epoch = 0, epochs - 1 do
    local sum = 0
    for _, b in ipairs(batches) do
      local data, target = b[1], b[2]
      dist_autograd.context(function(ctx_id)
        hidden = {hidden[1]:detach(), hidden[2]:detach()}
        local output
        output, hidden = model(data, hidden)
        local loss = criterion(output:view(-1, ntoken), target:view(-1))
        dist_autograd.backward(ctx_id, {loss})
        opt:step(ctx_id)
        sum = sum + loss:item()
      end)
    end
    first = first or sum / #batches
    last = sum / #batches
    if not quiet then print(("Training epoch %d"):format(epoch)) end
  end
  print(("epochs %d  first_loss %.4f  last_loss %.4f  s_per_epoch %.4f"):format(epochs, first, last,
    (rpc.time() - t0) / epochs))
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
if rank == 1 then
  rpc.init_rpc("trainer", {rank = rank, world_size = world_size})
  run_trainer()
else
  rpc.init_rpc("ps", {rank = rank, world_size = world_size})
end
rpc.shutdown()
