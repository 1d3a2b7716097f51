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

return M
