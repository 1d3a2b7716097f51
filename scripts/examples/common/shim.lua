-- examples/common/shim.lua: what the examples use from nn and tensor that a
-- tree may not have yet (nn.Dropout, tensor.distributions.Categorical): the
-- library's own when it has them, else a minimal local version with the same
-- semantics, so the programs read as PyTorch's either way.
local tensor = require "tensor"
local nn = require "nn"

local M = {}

if nn.Dropout then
  M.Dropout = nn.Dropout
else
  -- zeroes each element with probability p in training mode, scaling the rest by 1/(1-p)
  M.Dropout = nn.Module:extend("Dropout")
  function M.Dropout:init(opts)
    self.p = type(opts) == "table" and opts.p or opts or 0.5
  end
  function M.Dropout:forward(x)
    if not self.training or self.p == 0 then return x end
    local keep = tensor.bernoulli(tensor.full(x:size(), 1 - self.p))
    return x * keep / (1 - self.p)
  end
end

if tensor.distributions and tensor.distributions.Categorical then
  M.Categorical = tensor.distributions.Categorical
else
  -- Categorical(probs) over the last dim: sample() gives 0-based int64 actions
  -- of probs' shape without its last dim (as PyTorch's), log_prob(a) the log
  -- probability of each
  local C = {}
  C.__index = C
  M.Categorical = function(probs) return setmetatable({probs = probs}, C) end
  local function batch_shape(p)
    local s = {}
    for d = 1, p:dim() - 1 do s[d] = p:size(d) end
    return s
  end
  function C:sample()
    local p = self.probs:detach()
    local k = p:size(p:dim())
    return (tensor.multinomial(p:reshape(-1, k), 1) - 1):view(batch_shape(p))
  end
  function C:log_prob(a)
    local p = self.probs
    local k = p:size(p:dim())
    return p:log():reshape(-1, k):gather(2, (a:reshape(-1) + 1):view(-1, 1)):view(batch_shape(p))
  end
end

if nn.EmbeddingBag then
  M.EmbeddingBag = nn.EmbeddingBag
else
  -- EmbeddingBag(num_embeddings, embedding_dim, {mode = "sum" | "mean"}):
  -- forward(indices, offsets) with 0-based int64 indices and bag starts, as PyTorch's
  M.EmbeddingBag = nn.Module:extend("EmbeddingBag")
  function M.EmbeddingBag:init(num, dim, opts)
    self.num_embeddings, self.embedding_dim = num, dim
    self.mode = opts and opts.mode or "mean"
    self.weight = tensor.randn(num, dim)
    self:register_parameter("weight", self.weight)
  end
  function M.EmbeddingBag:forward(indices, offsets)
    local n, b = indices:numel(), offsets:numel()
    local rows = self.weight:index_select(1, indices + 1)
    -- bag of each index: how many offsets are <= its position
    local bag, counts, starts = {}, {}, offsets:totable()
    local k = 0
    for i = 0, n - 1 do
      while k < b and starts[k + 1] <= i do k = k + 1 end
      bag[i + 1] = k - 1
      counts[k] = (counts[k] or 0) + 1
    end
    local out = tensor.zeros(b, self.embedding_dim):index_add(1, tensor.tensor(bag, {dtype = tensor.int64}) + 1, rows)
    if self.mode == "mean" then
      local c = {}
      for j = 1, b do c[j] = math.max(counts[j] or 0, 1) end
      out = out / tensor.tensor(c):view(b, 1)
    end
    return out
  end
end

return M
