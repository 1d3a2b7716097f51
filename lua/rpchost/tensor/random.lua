-- rpchost.tensor.random: random tensors and their generators: rand, randn,
-- randint, randperm, bernoulli, multinomial, and tensor.Generator. The
-- generator is PyTorch 1.13's CPU generator (host/tensor/generator.c) and the
-- draws are its CPU kernels' (host/tensor/random.c), so tensor.manual_seed(s)
-- or a Generator seeded with s gives torch's numbers for rand, randn, randint
-- and randperm. Random tensors are made on the host and moved to the device
-- asked for, so their numbers are the host generator's on every device.
-- Results that are indices (randperm, multinomial) are 1-based int64, as every
-- index in the API: randperm(n) is torch's permutation plus one. A family of
-- the tensor API (rpchost.tensor lists the families in the order they are
-- installed); none has a derivative.
local ffi = require "ffi"
local core = require "rpchost.core"
local tensor = require "rpchost.tensor.base"

local methods = tensor.methods
local call, scalar, expect_tensor = tensor._call, tensor._scalar, tensor._expect_tensor
local sizes_and_options, check_opts, finish = tensor._sizes_and_options, tensor._check_opts, tensor._finish
local state = tensor._state
local BASE = 1 -- index tensors are 1-based here

-- Generator ---------------------------------------------------------------------------
-- A userdata (bindings/l_generator.c) with torch.Generator's methods. Seeds are
-- 64-bit: they cross to C as two 32-bit halves, and come back as numbers, or
-- as uint64 cdata past 2^53 where a number would round.
local GenMT = core.gen_metatable()
local Generator = {}
GenMT.__index = Generator
GenMT.__tostring = function() return "tensor.Generator(device='cpu')" end

local function is_generator(v) return type(v) == "userdata" and getmetatable(v) == GenMT end
tensor.is_generator = is_generator

local TWO32 = 4294967296
-- a whole number in [-2^63, 2^64) or an int64/uint64 cdata, as its high and low
-- 32 bits (a negative seed as its two's complement, as torch takes it)
local function seed_halves(s, what)
  local u
  if type(s) == "number" then
    if s ~= s or s % 1 ~= 0 or s < -2 ^ 63 or s >= 2 ^ 64 then
      error(("%s: the seed must be a whole number in [-2^63, 2^64), got %s"):format(what, tostring(s)), 3)
    end
    u = s < 0 and ffi.cast("uint64_t", ffi.cast("int64_t", s)) or ffi.cast("uint64_t", s)
  elseif type(s) == "cdata" and (ffi.istype("int64_t", s) or ffi.istype("uint64_t", s)) then
    u = ffi.cast("uint64_t", s)
  else
    error(("%s: the seed must be a whole number, got %s"):format(what, type(s)), 3)
  end
  return tonumber(u / TWO32), tonumber(u % TWO32)
end
local function seed_value(hi, lo)
  if hi < 2 ^ 21 then return hi * TWO32 + lo end -- below 2^53: exact as a number
  return ffi.cast("uint64_t", hi) * TWO32 + lo
end

-- g:manual_seed(s) -> g: the state torch's generator has after manual_seed(s)
function Generator.manual_seed(g, s)
  core.gen_manual_seed(g, seed_halves(s, "Generator.manual_seed"))
  return g
end
-- g:initial_seed(): the seed it was last seeded with
function Generator.initial_seed(g) return seed_value(core.gen_initial_seed(g)) end
-- g:seed(): reseeds it from the OS (53 random bits) and returns the seed
function Generator.seed(g) return seed_value(core.gen_seed(g)) end
-- g:get_state(): a uint8 tensor of 5,056 bytes in the layout of torch's
-- Generator.get_state(), so states move between the two; g:set_state(t) -> g
function Generator.get_state(g) return core.gen_get_state(g) end
function Generator.set_state(g, t)
  call(core.gen_set_state, g, expect_tensor(t, "Generator.set_state", "the state"))
  return g
end

-- tensor.Generator([device]): a new generator, seeded as a new torch.Generator()
-- is (67280421310721). Only "cpu": rpchost draws every random tensor on the
-- host (torch's CUDA generator is another algorithm, Philox).
function tensor.Generator(device)
  if device ~= nil and device ~= "cpu" then
    error(("tensor.Generator: only 'cpu' generators exist (random tensors are drawn on the host and moved " ..
      "to their device), got %s"):format(tostring(device)), 2)
  end
  return core.gen_new()
end

-- The default generator, which every random op without generator= draws from.
-- It starts from a new torch.Generator()'s seed, where torch seeds its default
-- one from the OS: a run that never seeds repeats.
tensor.default_generator = core.gen_default()
-- manual_seed(s) seeds the default generator and returns it, as torch's does
function tensor.manual_seed(s)
  core.gen_manual_seed(tensor.default_generator, seed_halves(s, "manual_seed"))
  return tensor.default_generator
end
function tensor.initial_seed() return tensor.default_generator:initial_seed() end
function tensor.seed() return tensor.default_generator:seed() end
function tensor.get_rng_state() return tensor.default_generator:get_state() end
function tensor.set_rng_state(t) tensor.default_generator:set_state(t) end

-- the generator= option, for the C entry points (nil: the default generator)
local function generator_of(opts, what)
  local g = opts.generator
  if g ~= nil and not is_generator(g) then
    error(("%s: generator must be a tensor.Generator, got %s"):format(what, type(g)), 3)
  end
  return g
end

-- rand(sizes..., {dtype, device, requires_grad, generator}): uniform in [0, 1)
function tensor.rand(...)
  local sizes, opts = sizes_and_options(...)
  local dev = check_opts(opts, "rand", "generator")
  local g = generator_of(opts, "rand")
  return finish(call(core.t_rand, (opts.dtype or state.default_dtype).id, sizes, false, g), opts, dev)
end

-- randn(sizes..., {dtype, device, requires_grad, generator}): standard normal
function tensor.randn(...)
  local sizes, opts = sizes_and_options(...)
  local dev = check_opts(opts, "randn", "generator")
  local g = generator_of(opts, "randn")
  return finish(call(core.t_rand, (opts.dtype or state.default_dtype).id, sizes, true, g), opts, dev)
end

-- randint([low,] high, size [, opts]): integers in [low, high), int64 by default
local function randint(a, b, c, d)
  local low, high, size, opts
  if type(b) == "table" and not tensor._is_options(b, true) then low, high, size, opts = 0, a, b, c
  else low, high, size, opts = a, b, c, d end
  opts = opts or {}
  local dev = check_opts(opts, "randint", "generator")
  local g = generator_of(opts, "randint")
  if type(size) ~= "table" then error("randint: the size must be a table (randint(high, {2, 3}))", 2) end
  local sz = sizes_and_options(size)
  local dt = opts.dtype or tensor.int64
  return finish(call(core.t_randint, dt.id, scalar(low, "randint", "low"), scalar(high, "randint", "high"), sz, g),
    opts, dev)
end
tensor.randint, methods.randint = randint, randint

-- randperm(n [, opts]): a random permutation of 1..n (1-based, usable as
-- indices): torch's randperm(n) + 1 for the same generator state
local function randperm(n, opts)
  opts = opts or {}
  local dev = check_opts(opts, "randperm", "generator")
  local g = generator_of(opts, "randperm")
  return finish(call(core.t_randperm, (opts.dtype or tensor.int64).id, scalar(n, "randperm", "n"), BASE, g), opts,
    dev)
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
