-- rpchost.tensor.random: random tensors from the one generator of the process
-- (host/tensor/random.c), seeded by tensor.manual_seed: rand, randn, randint,
-- randperm, bernoulli, multinomial. Random tensors are made on the host and
-- moved to the device asked for, so their numbers match the host's generator on
-- every device. Results that are indices (randperm, multinomial) are 1-based
-- int64, as every index in the API. A family of the tensor API (rpchost.tensor
-- lists the families in the order they are installed); none has a derivative.
local core = require "rpchost.core"
local tensor = require "rpchost.tensor.base"

local methods = tensor.methods
local call, scalar, expect_tensor = tensor._call, tensor._scalar, tensor._expect_tensor
local sizes_and_options, check_opts, finish = tensor._sizes_and_options, tensor._check_opts, tensor._finish
local state = tensor._state
local BASE = 1 -- index tensors are 1-based here

function tensor.manual_seed(seed) core.t_seed(seed) end

function tensor.rand(...)
  local sizes, opts = sizes_and_options(...)
  local dev = check_opts(opts, "rand")
  return finish(call(core.t_rand, (opts.dtype or state.default_dtype).id, sizes, false), opts, dev)
end

function tensor.randn(...)
  local sizes, opts = sizes_and_options(...)
  local dev = check_opts(opts, "randn")
  return finish(call(core.t_rand, (opts.dtype or state.default_dtype).id, sizes, true), opts, dev)
end

-- randint([low,] high, size [, opts]): integers in [low, high), int64 by default
local function randint(a, b, c, d)
  local low, high, size, opts
  if type(b) == "table" and not tensor._is_options(b, true) then low, high, size, opts = 0, a, b, c
  else low, high, size, opts = a, b, c, d end
  opts = opts or {}
  local dev = check_opts(opts, "randint")
  if type(size) ~= "table" then error("randint: the size must be a table (randint(high, {2, 3}))", 2) end
  local sz = sizes_and_options(size)
  local dt = opts.dtype or tensor.int64
  return finish(call(core.t_randint, dt.id, scalar(low, "randint", "low"), scalar(high, "randint", "high"), sz), opts, dev)
end
tensor.randint, methods.randint = randint, randint

-- randperm(n): a random permutation of 1..n (1-based, usable as indices)
local function randperm(n, opts)
  opts = opts or {}
  local dev = check_opts(opts, "randperm")
  return finish(call(core.t_randperm, (opts.dtype or tensor.int64).id, scalar(n, "randperm", "n"), BASE), opts, dev)
end
tensor.randperm, methods.randperm = randperm, randperm

-- bernoulli(p): 0/1 with the probabilities in p; t:bernoulli(q) with a number q
local function bernoulli(p, q)
  if q ~= nil then p = core.t_full(core.t_dtype(p), core.t_size(p), scalar(q, "bernoulli", "p"), core.t_device(p)) end
  return call(core.t_bernoulli, expect_tensor(p, "bernoulli", "p"))
end
tensor.bernoulli, methods.bernoulli = bernoulli, bernoulli

-- multinomial(weights, k, replacement = false): k 1-based category indices per row
local function multinomial(w, k, replacement)
  if type(replacement) == "table" then replacement = replacement.replacement end
  return call(core.t_multinomial, expect_tensor(w, "multinomial", "the weights"), scalar(k, "multinomial", "num_samples"),
    replacement and true or false, BASE)
end
tensor.multinomial, methods.multinomial = multinomial, multinomial

return tensor
