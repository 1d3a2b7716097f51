-- rpchost.nn.distributions: tensor.distributions, the parts of
-- torch.distributions that policy-gradient RL code uses: Categorical, Normal,
-- Bernoulli with sample, log_prob, entropy and their parameters. Categories
-- are 1-based int64 (Lua's convention); log_prob and entropy are
-- differentiable in the parameters, rsample (Normal) in loc and scale.
local M = {}

function M.install(tensor)
  local D = {}
  tensor.distributions = D

  local function class(name)
    local cls = {name = name}
    cls.__index = cls
    cls.__tostring = function(d) return d:_repr() end
    setmetatable(cls, {__call = function(c, ...) return c.new(...) end})
    D[name] = cls
    return cls
  end
  local function as_tensor(v, like)
    if tensor.is_tensor(v) then return v end
    if type(v) == "number" then
      return tensor.tensor(v, {dtype = like and like.dtype or tensor.get_default_dtype()})
    end
    error("distributions: expected a tensor or a number, got " .. type(v), 3)
  end
  local function shape(t)
    local s, o = t:size(), {}
    for i = 1, #s do o[i] = s[i] end
    return o
  end
  local function sample_shape(ss, base)
    local out = {}
    if type(ss) == "number" then ss = {ss} end
    for _, v in ipairs(ss or {}) do out[#out + 1] = v end
    for _, v in ipairs(base) do out[#out + 1] = v end
    return out
  end
  local function softplus(x) return (-(x:abs())):exp():log1p() + x:clamp_min(0) end

  -- Categorical(probs) or Categorical{probs =} / Categorical{logits =}: over the last dim
  local Categorical = class("Categorical")
  function Categorical.new(a)
    local probs, logits
    if tensor.is_tensor(a) then probs = a
    elseif type(a) == "table" then probs, logits = a.probs, a.logits end
    if (probs == nil) == (logits == nil) then
      error("Categorical: either `probs` or `logits` must be specified, but not both", 2)
    end
    local d = setmetatable({}, Categorical)
    if probs ~= nil then
      if probs:dim() < 1 then error("Categorical: probs must have at least one dimension", 2) end
      d.probs = probs / probs:sum(probs:dim(), true)
      d.logits = d.probs:clamp_min(1e-38):log()
    else
      if logits:dim() < 1 then error("Categorical: logits must have at least one dimension", 2) end
      d.logits = logits - logits:logsumexp(logits:dim(), true)
      d.probs = d.logits:exp()
    end
    d.num_events = d.probs:size(d.probs:dim())
    d.batch_shape = shape(d.probs)
    d.batch_shape[#d.batch_shape] = nil
    return d
  end
  -- sample(sample_shape = {}): 1-based category indices, int64
  function Categorical:sample(ss)
    local p = self.probs:detach():reshape(-1, self.num_events)
    local n = 1
    if type(ss) == "number" then n = ss elseif type(ss) == "table" then for _, v in ipairs(ss) do n = n * v end end
    local draws = tensor.multinomial(p, n, true) -- [B, n]
    local out = draws:t():contiguous()
    return out:reshape(sample_shape(ss, self.batch_shape))
  end
  function Categorical:log_prob(v)
    v = v:to(tensor.int64)
    local lg = self.logits
    if #self.batch_shape == 0 then
      return lg:index_select(1, v:reshape(-1)):view(shape(v))
    end
    -- broadcast v against the batch: gather along the last dim
    local vb = v:unsqueeze(-1)
    local ls = shape(vb)
    ls[#ls] = self.num_events
    return lg:expand(ls):gather(#ls, vb):squeeze(-1)
  end
  function Categorical:entropy()
    local lg = self.logits:clamp_min(-3.4028234663852886e38)
    return -(lg * self.probs):sum(self.probs:dim())
  end
  function Categorical:_repr()
    return ("Categorical(probs: %s)"):format(tostring(self.probs:size()))
  end

  -- Normal(loc, scale)
  local Normal = class("Normal")
  function Normal.new(loc, scale)
    if type(loc) == "table" and not tensor.is_tensor(loc) then loc, scale = loc.loc, loc.scale end
    local d = setmetatable({}, Normal)
    d.loc = as_tensor(loc, tensor.is_tensor(scale) and scale or nil)
    d.scale = as_tensor(scale, d.loc)
    if d.scale:le(0):any():item() then error("Normal: scale must be positive", 2) end
    d.mean, d.stddev = d.loc, d.scale
    d.variance = d.scale * d.scale
    return d
  end
  local function bshape(d) return shape(d.loc + d.scale) end
  function Normal:sample(ss)
    return tensor.no_grad(function() return self:rsample(ss) end)
  end
  function Normal:rsample(ss)
    local s = sample_shape(ss, bshape(self))
    return self.loc + self.scale * tensor.randn(s, {dtype = self.loc.dtype, device = self.loc.device})
  end
  function Normal:log_prob(v)
    v = as_tensor(v, self.loc)
    local d = v - self.loc
    return -(d * d) / (self.variance * 2) - self.scale:log() - math.log(math.sqrt(2 * math.pi))
  end
  function Normal:entropy() return self.scale:log() + (0.5 + 0.5 * math.log(2 * math.pi)) end
  function Normal:cdf(v)
    local F = require "rpchost.nn.functional"
    return (F._erf((as_tensor(v, self.loc) - self.loc) / (self.scale * math.sqrt(2))) + 1) * 0.5
  end
  function Normal:_repr()
    return ("Normal(loc: %s, scale: %s)"):format(tostring(self.loc:size()), tostring(self.scale:size()))
  end

  -- Bernoulli(probs) or Bernoulli{probs =} / Bernoulli{logits =}
  local Bernoulli = class("Bernoulli")
  function Bernoulli.new(a)
    local probs, logits
    if tensor.is_tensor(a) or type(a) == "number" then probs = a
    elseif type(a) == "table" then probs, logits = a.probs, a.logits end
    if (probs == nil) == (logits == nil) then
      error("Bernoulli: either `probs` or `logits` must be specified, but not both", 2)
    end
    local d = setmetatable({}, Bernoulli)
    if probs ~= nil then
      d.probs = as_tensor(probs)
      local p = d.probs:clamp(1.1920928955078125e-07, 1 - 1.1920928955078125e-07)
      d.logits = p:log() - (1 - p):log()
    else
      d.logits = as_tensor(logits)
      d.probs = d.logits:sigmoid()
    end
    d.mean = d.probs
    d.variance = d.probs * (1 - d.probs)
    return d
  end
  function Bernoulli:sample(ss)
    local s = sample_shape(ss, shape(self.probs))
    local p = self.probs:detach():expand(s):contiguous()
    return tensor.bernoulli(p)
  end
  function Bernoulli:log_prob(v)
    v = as_tensor(v, self.logits)
    -- -BCEWithLogits(logits, v)
    return -((1 - v) * self.logits + softplus(-self.logits))
  end
  -- H = -p log p - (1 - p) log(1 - p) = softplus(-logits) + (1 - p) * logits
  function Bernoulli:entropy() return softplus(-self.logits) + (1 - self.probs) * self.logits end
  function Bernoulli:_repr() return ("Bernoulli(probs: %s)"):format(tostring(self.probs:size())) end
end

return M
