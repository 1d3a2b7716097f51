-- randn's samples are standard normal: their distribution (Kolmogorov-Smirnov
-- against the normal CDF), their tails, and joint normality of samples far and
-- near in the buffer (a pair of independent standard normals has a uniform angle
-- and an exponential squared radius), for both float dtypes and sizes that end
-- mid-block. Seeds are fixed, so the statistics cannot flake: the bounds are
-- the 1-in-1000 critical values, which a wrong generator exceeds by far.
local tensor = require "tensor"

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

  it("repeats with a seed and gives the same draws in float32 and float64", function()
    for _, n in ipairs({1, 2, 3, 255, 256, 257, 1000}) do
      tensor.manual_seed(5)
      local a = tensor.randn(n, {dtype = tensor.float64})
      tensor.manual_seed(5)
      local b = tensor.randn(n, {dtype = tensor.float64})
      tensor.manual_seed(5)
      local c = tensor.randn(n)
      assert.is_true(a:equal(b))
      assert.is_true(a:float():equal(c), "size " .. n)
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
