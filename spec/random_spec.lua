-- The random ops against PyTorch: the generator is torch 1.13's CPU generator,
-- so rand, randn, randint, randperm, Generator's seeds and saved states, and
-- DistributedSampler's order are compared value for value with what torch gave
-- (spec/fixtures/random/, written by scripts/gen_random_fixtures.py; the suite
-- never needs torch).
-- Then randn's samples are standard normal: their distribution
-- (Kolmogorov-Smirnov against the normal CDF), their tails, and joint normality
-- of samples far and near in the buffer (a pair of independent standard normals
-- has a uniform angle and an exponential squared radius), for both float dtypes
-- and sizes that end mid-block. Seeds are fixed, so the statistics cannot
-- flake: the bounds are the 1-in-1000 critical values, which a wrong generator
-- exceeds by far. Last, int64 tensors print exactly.
local ffi = require "ffi"
local tensor = require "tensor"
local core = require "rpchost.core"

local FIXTURES = "spec/fixtures/random/"
local fx = dofile(FIXTURES .. "streams.lua")
local sampler_fx = dofile(FIXTURES .. "sampler.lua")

-- t's elements as a Lua list: numbers, or int64 cdata (exact) for an int64 t
local function elements(t)
  t = t:contiguous()
  if t.dtype ~= tensor.int64 then return t:double():totable() end
  local bytes, out = core.t_bytes(t), {}
  local p = ffi.cast("const int64_t *", bytes)
  for i = 1, t:numel() do out[i] = p[i - 1] end
  return out
end

-- got (a list) equals want (a fixture list) plus `plus` everywhere, exactly
local function same_list(got, want, what, plus)
  plus = plus or 0
  assert.are.equal(#want, #got, what .. ": the number of values")
  for i = 1, #want do
    local w = want[i] + plus
    if got[i] ~= w then
      error(("%s: element %d is %s, torch gives %s"):format(what, i, tostring(got[i]), tostring(w)), 2)
    end
  end
end
local function same(t, want, what, plus) same_list(elements(t), want, what, plus) end

-- the values of a sampled fixture (n, at = 0-based positions, values) in xs
local function same_at(xs, want, what, plus)
  assert.are.equal(want.n, #xs, what .. ": the number of values")
  for k, pos in ipairs(want.at) do
    local w = want.values[k] + (plus or 0)
    if xs[pos + 1] ~= w then
      error(("%s: element %d is %s, torch gives %s"):format(what, pos + 1, tostring(xs[pos + 1]), tostring(w)), 2)
    end
  end
end

local DTYPES = {float32 = tensor.float32, float64 = tensor.float64, int32 = tensor.int32, int64 = tensor.int64}

local function hex(t)
  return (core.t_bytes(t):gsub(".", function(c) return ("%02x"):format(c:byte()) end))
end
local function from_hex(h)
  local bytes = {}
  for i = 1, #h, 2 do bytes[#bytes + 1] = tonumber(h:sub(i, i + 1), 16) end
  return tensor.tensor(bytes, {dtype = tensor.uint8})
end

describe("the generator is torch's #unit", function()
  it("starts where a new torch.Generator() starts", function()
    assert.are.equal(fx.default_seed, tensor.Generator():initial_seed())
  end)

  for _, st in ipairs(fx.streams) do
    it("gives torch's randperm, randint, rand and randn after manual_seed(" .. tostring(st.seed) .. ")", function()
      local g = tensor.Generator()
      local function fresh() return g:manual_seed(st.seed) end
      assert.are.equal(st.initial_seed, fresh():initial_seed())
      for _, c in ipairs(st.randperm) do
        same(tensor.randperm(c.n, {generator = fresh()}), c.values, "randperm(" .. c.n .. ")", 1)
      end
      local big = tensor.randperm(st.randperm_big.n, {generator = fresh()}):totable()
      same_at(big, st.randperm_big, "randperm(" .. st.randperm_big.n .. ")", 1)
      local sum = 0
      for i, v in ipairs(big) do sum = sum + i * (v - 1) end
      assert.are.equal(st.randperm_big.weighted_sum, sum, "randperm(50000): the checksum of every position")
      for _, c in ipairs(st.randint) do
        local t = tensor.randint(c.low, c.high, {#c.values}, {dtype = DTYPES[c.dtype], generator = fresh()})
        same(t, c.values, ("randint(%s, %s) in %s"):format(tostring(c.low), tostring(c.high), c.dtype))
      end
      for _, c in ipairs(st.rand) do
        same(tensor.rand(#c.values, {dtype = DTYPES[c.dtype], generator = fresh()}), c.values, "rand in " .. c.dtype)
      end
      for _, c in ipairs(st.randn) do
        local t = tensor.randn(c.n, {dtype = DTYPES[c.dtype], generator = fresh()})
        local what = ("randn(%d) in %s"):format(c.n, c.dtype)
        if c.at then same_at(t:double():totable(), c, what) else same(t, c.values, what) end
      end
    end)
  end

  it("seeds the default generator with manual_seed, which returns it", function()
    local st = fx.streams[3]
    assert.are.equal(tensor.default_generator, tensor.manual_seed(st.seed))
    same(tensor.randperm(100), st.randperm[4].values, "randperm(100)", 1)
    tensor.manual_seed(st.seed)
    local c -- float32, 16: the first size torch turns 16 at a time
    for _, x in ipairs(st.randn) do if x.dtype == "float32" and x.n == 16 then c = x end end
    same(tensor.randn(16), c.values, "randn(16)")
    assert.are.equal(st.seed, tensor.initial_seed())
  end)

  it("carries the draws, and randn's kept sample, from call to call", function()
    local seq = fx.sequence
    local function run(opts_for)
      for k, step in ipairs(seq.steps) do
        local o = opts_for()
        local t
        if step.op == "randn" then o.dtype = DTYPES[step.dtype]; t = tensor.randn(step.n, o)
        elseif step.op == "rand" then o.dtype = DTYPES[step.dtype]; t = tensor.rand(step.n, o)
        elseif step.op == "randperm" then t = tensor.randperm(step.n, o)
        else t = tensor.randint(0, 100, {step.n}, o) end
        same(t, step.values, ("step %d, %s(%d)"):format(k, step.op, step.n), step.op == "randperm" and 1 or 0)
      end
    end
    local g = tensor.Generator():manual_seed(seq.seed)
    run(function() return {generator = g} end)
    tensor.manual_seed(seq.seed)
    run(function() return {} end)
  end)

  it("saves and restores its state in torch's layout", function()
    local s = fx.state
    local g = tensor.Generator():manual_seed(s.seed)
    local st = g:get_state()
    assert.are.equal(tensor.uint8, st.dtype)
    assert.are.equal(s.fresh, hex(st))
    tensor.randn(3, {dtype = tensor.float64, generator = g})
    assert.are.equal(s.after_randn3, hex(g:get_state()), "the state holds randn's kept sample")
    -- torch's state, loaded here, goes on as torch did (the kept sample first)
    local h = tensor.Generator()
    assert.are.equal(h, h:set_state(from_hex(s.after_randn3)))
    same(tensor.randn(4, {dtype = tensor.float64, generator = h}), s.then_randn4, "randn(4) after set_state")
    assert.are.equal(s.seed, h:initial_seed())
    -- the default generator's, through tensor.get_rng_state / set_rng_state
    tensor.manual_seed(1)
    local saved = tensor.get_rng_state()
    local a = tensor.rand(5)
    tensor.set_rng_state(saved)
    assert.is_true(a:equal(tensor.rand(5)))
  end)

  it("refuses a state that is not one", function()
    local g = tensor.Generator()
    assert.has_error(function() g:set_state(tensor.zeros(10, {dtype = tensor.uint8})) end,
      "set_state: expected 5056 bytes (a state from get_state), got 10")
    assert.has_error(function() g:set_state(tensor.zeros(5056)) end, "set_state: expected a uint8 tensor, got float32")
    local bad = g:get_state()
    bad[9] = 0 -- left = 0: no position mt19937 can be at
    local ok, err = pcall(g.set_state, g, bad)
    assert.is_false(ok)
    assert.matches("not a valid generator state", tostring(err))
  end)

  it("takes torch's seeds: 64-bit ones exactly, negative ones as two's complement", function()
    local g = tensor.Generator()
    assert.are.equal(2 ^ 40 + 3, g:manual_seed(2 ^ 40 + 3):initial_seed())
    local a = tensor.randperm(20, {generator = g})
    -- the state is seeded from the low 32 bits, as torch's is
    assert.is_true(a:equal(tensor.randperm(20, {generator = g:manual_seed(3)})))
    assert.are.equal(18446744073709551615ULL, g:manual_seed(-1):initial_seed())
    local b = tensor.randperm(20, {generator = g})
    assert.is_true(b:equal(tensor.randperm(20, {generator = g:manual_seed(4294967295)})))
    assert.are.equal(9223372036854775808ULL, g:manual_seed(-9223372036854775807LL - 1):initial_seed())
    assert.are.equal(12345, g:manual_seed(12345ULL):initial_seed())
    assert.has_error(function() g:manual_seed(1.5) end,
      "Generator.manual_seed: the seed must be a whole number in [-2^63, 2^64), got 1.5")
    assert.has_error(function() tensor.manual_seed("7") end, "manual_seed: the seed must be a whole number, got string")
    -- seed(): 53 random bits, which it then repeats from
    local s = g:seed()
    assert.is_true(type(s) == "number" and s >= 0 and s < 2 ^ 53 and s % 1 == 0)
    assert.are.equal(s, g:initial_seed())
    local c = tensor.rand(4, {generator = g})
    assert.is_true(c:equal(tensor.rand(4, {generator = g:manual_seed(s)})))
  end)

  it("checks the generator option", function()
    assert.has_error(function() tensor.rand(2, {generator = 5}) end, "rand: generator must be a tensor.Generator, got number")
    assert.has_error(function() tensor.randperm(2, {gen = tensor.Generator()}) end,
      "randperm: unknown option 'gen' (dtype, requires_grad, device, generator)")
    assert.has_error(function() tensor.Generator("cuda") end)
    assert.has_error(function() tensor.zeros(2, {generator = tensor.Generator()}) end,
      "zeros: unknown option 'generator' (dtype, requires_grad, device)")
  end)
end)

describe("DistributedSampler shuffles as torch's #unit", function()
  local dist = require "dist"
  it("gives rank 0 of 3 torch's 5, 6, 1, 3 (1-based) of 10 items for seed 0, epoch 0", function()
    assert.are.same({5, 6, 1, 3}, dist.DistributedSampler(10, {rank = 0, world_size = 3, seed = 0}):indices())
  end)
  for _, c in ipairs(sampler_fx.cases) do
    local name = ("n %d, world %d, seed %d, epoch %d, drop_last %s, shuffle %s"):format(c.n, c.world, c.seed, c.epoch,
      tostring(c.drop_last), tostring(c.shuffle))
    it("gives every rank torch's indices: " .. name, function()
      for r = 0, c.world - 1 do
        local s = dist.DistributedSampler(c.n, {rank = r, world_size = c.world, seed = c.seed, drop_last = c.drop_last,
          shuffle = c.shuffle})
        s:set_epoch(c.epoch)
        same_list(s:indices(), c.ranks[r + 1], "rank " .. r, 1)
        assert.are.equal(#c.ranks[r + 1], s:len())
      end
    end)
  end
end)

-- erfc with fractional error below 1.2e-7 (Numerical Recipes' erfcc)
local function erfc(x)
  local z = math.abs(x)
  local t = 1 / (1 + 0.5 * z)
  local r = t * math.exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
    t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 +
    t * 0.17087277)))))))))
  return x >= 0 and r or 2 - r
end
local function normal_cdf(x) return 0.5 * erfc(-x / math.sqrt(2)) end

-- the Kolmogorov-Smirnov distance between the values and a CDF
local function ks(values, cdf)
  table.sort(values)
  local n, d = #values, 0
  for i, v in ipairs(values) do
    local f = cdf(v)
    d = math.max(d, math.abs(f - (i - 1) / n), math.abs(i / n - f))
  end
  return d
end
-- the 0.001 critical value of the KS distance for n samples
local function ks_bound(n) return 1.95 / math.sqrt(n) end

describe("randn #unit", function()
  for _, dt in ipairs({tensor.float64, tensor.float32}) do
    it("is standard normal in " .. tostring(dt), function()
      tensor.manual_seed(7)
      local n = 100003 -- not a whole number of blocks
      local x = tensor.randn(n, {dtype = dt})
      assert.are.equal(dt, x.dtype)
      local v = x:double():totable()
      assert.are.equal(n, #v)
      local m, m2, m4, over3, over4 = 0, 0, 0, 0, 0
      for _, a in ipairs(v) do
        m, m2, m4 = m + a, m2 + a * a, m4 + a ^ 4
        if math.abs(a) > 3 then over3 = over3 + 1 end
        if math.abs(a) > 4 then over4 = over4 + 1 end
      end
      m, m2, m4 = m / n, m2 / n, m4 / n
      -- standard errors: 1/sqrt(n) for the mean, sqrt(2/n) for the variance, sqrt(96/n) for the 4th moment
      assert.is_true(math.abs(m) < 3.3 / math.sqrt(n), "mean " .. m)
      assert.is_true(math.abs(m2 - 1) < 3.3 * math.sqrt(2 / n), "variance " .. m2)
      assert.is_true(math.abs(m4 - 3) < 3.3 * math.sqrt(96 / n), "fourth moment " .. m4)
      -- P(|x| > 3) = 0.0027 (270 of 1e5), P(|x| > 4) = 6.3e-5 (6.3): tails reach as far as they should
      assert.is_true(over3 > 215 and over3 < 325, "beyond 3 sd: " .. over3)
      assert.is_true(over4 >= 1 and over4 < 20, "beyond 4 sd: " .. over4)
      local d = ks(v, normal_cdf)
      assert.is_true(d < ks_bound(n), ("KS distance %g >= %g"):format(d, ks_bound(n)))
    end)
  end

  it("draws independent samples: any two positions make a uniform angle and an exponential radius", function()
    tensor.manual_seed(11)
    local rows = 4000
    local x = tensor.randn(rows, 600, {dtype = tensor.float64}):totable()
    -- neighbours, positions half a block apart and far apart in the same draw
    for _, gap in ipairs({1, 128, 256, 599}) do
      local angles, radii = {}, {}
      for r = 1, rows do
        local a, b = x[r][1], x[r][1 + gap]
        angles[r] = math.atan2(b, a)
        radii[r] = a * a + b * b
      end
      local da = ks(angles, function(t) return (t + math.pi) / (2 * math.pi) end)
      local dr = ks(radii, function(s) return 1 - math.exp(-s / 2) end)
      assert.is_true(da < ks_bound(rows), ("gap %d: angle KS %g"):format(gap, da))
      assert.is_true(dr < ks_bound(rows), ("gap %d: radius KS %g"):format(gap, dr))
    end
  end)

  it("repeats with a seed, and below 16 elements gives float32 the float64 draws rounded", function()
    for _, n in ipairs({1, 2, 3, 15, 16, 17, 255, 256, 257, 1000}) do
      tensor.manual_seed(5)
      local a = tensor.randn(n, {dtype = tensor.float64})
      tensor.manual_seed(5)
      local b = tensor.randn(n, {dtype = tensor.float64})
      assert.is_true(a:equal(b))
      tensor.manual_seed(5)
      local c = tensor.randn(n)
      tensor.manual_seed(5)
      assert.is_true(c:equal(tensor.randn(n)), "size " .. n)
      -- (torch's way: one float64 sample at a time below 16, then float32's own kernel)
      if n < 16 then assert.is_true(a:float():equal(c), "size " .. n) end
    end
    tensor.manual_seed(5)
    local a = tensor.randn(10)
    local b = tensor.randn(10)
    assert.is_false(a:equal(b), "a second draw differs from the first")
  end)

  it("keeps rand in [0, 1) in both float dtypes", function()
    tensor.manual_seed(3)
    for _, dt in ipairs({tensor.float32, tensor.float64}) do
      local u = tensor.rand(200000, {dtype = dt})
      assert.is_true(u:min():item() >= 0 and u:max():item() < 1)
      assert.is_true(math.abs(u:mean():item() - 0.5) < 0.005)
    end
  end)
end)

describe("printing int64 tensors #unit", function()
  it("prints every value exactly, past 2^53 too", function()
    local t = tensor.tensor({9007199254740993LL, -9007199254740993LL, 1LL})
    assert.are.equal("tensor([ 9007199254740993, -9007199254740993,                 1])", tostring(t))
    assert.are.equal("tensor(9223372036854775807)", tostring(tensor.tensor(9223372036854775807LL)))
    assert.are.equal("tensor([-9223372036854775808])", tostring(tensor.tensor({-9223372036854775807LL - 1})))
    -- a summarised one keeps its shown values exact
    local big = tensor.arange(0, 2000):long() + tensor.tensor(9007199254740993LL)
    assert.matches("9007199254740993,", tostring(big), 1, true)
    assert.matches("9007199254742992]", tostring(big), 1, true)
  end)
end)
