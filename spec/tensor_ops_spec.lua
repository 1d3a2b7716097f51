-- The ops models use (lua/rpchost/tensor/{shape,math,indexing,random}.lua, host/tensor/index.c, sort.c,
-- random.c): every op against numpy at test time, on contiguous and strided
-- (transposed) inputs and on each dtype it takes; every gradient against central
-- finite differences, and the indexing gradients against numpy too; the dtype
-- rule, argument parsing, bad input, and the version-bump call sites.
local tensor = require "tensor"
local S = require "spec.support"

local f64 = {dtype = tensor.float64}
local PY = "/usr/bin/python3"

local function numpy_ok() return os.execute(PY .. " -c 'import numpy' 2>/dev/null") == 0 end

local function raises(pattern, fn, ...)
  local ok, e = pcall(fn, ...)
  assert.is_false(ok, "expected an error matching " .. pattern)
  assert.truthy(tostring(e):find(pattern, 1, true), ("error %q does not contain %q"):format(tostring(e), pattern))
end

-- max |a - b| over all elements (shapes must match), NaN equal to NaN
local function assert_close(name, got, want, tol)
  assert.are.equal(tostring(want:size()), tostring(got:size()), name .. ": shape")
  if got:numel() == 0 then return end
  local g, w = got:double(), want:double()
  local both_nan = g:ne(g) * w:ne(w)
  local d = tensor.where(both_nan, tensor.zeros(1, f64), (g - w):abs())
  local scale = tensor.clamp(w:abs(), 1, nil)
  local worst = (d / tensor.where(w:ne(w), tensor.ones(1, f64), scale)):max():item()
  assert.is_true(worst <= (tol or 1e-12), ("%s: relative difference %g > %g"):format(name, worst, tol or 1e-12))
end

local gradcheck = S.gradcheck

describe("the dtype rule #unit", function()
  it("gives Lua numbers the default dtype, 5LL int64, booleans bool, index results int64", function()
    assert.are.equal(tensor.float32, tensor.tensor({1.0, 2.0}).dtype)
    assert.are.equal(tensor.float32, tensor.full({2}, 3.0).dtype)
    assert.are.equal(tensor.float32, tensor.tensor({1, 2}):mean().dtype)
    assert.are.equal(tensor.int64, tensor.tensor({5LL}).dtype)
    assert.are.equal(tensor.int64, tensor.full({2}, 5LL).dtype)
    assert.are.equal(tensor.bool, tensor.tensor({true, false}).dtype)
    assert.are.equal(tensor.int64, tensor.arange(3).dtype)
    assert.are.equal(tensor.float32, tensor.arange(0, 1, 0.5).dtype)
    local x = tensor.tensor({3, 1, 2})
    assert.are.equal(tensor.int64, x:argmax().dtype)
    assert.are.equal(tensor.int64, x:argsort().dtype)
    assert.are.equal(tensor.int64, tensor.nonzero(x).dtype)
    assert.are.equal(tensor.int64, tensor.randperm(4).dtype)
    assert.are.equal(tensor.int64, tensor.randint(5, {3}).dtype)
    assert.are.equal(tensor.int64, tensor.multinomial(tensor.ones(3), 2).dtype)
    -- int64 cdata stay exact beyond 2^53
    assert.are.equal(1, (tensor.tensor({9007199254740993LL}) - tensor.tensor({9007199254740992LL})):item())
    assert.are.equal(1, (tensor.full({1}, 9007199254740993LL) - tensor.full({1}, 9007199254740992LL)):item())
    -- nn.Linear takes tensors made from Lua numbers
    local nn = require "nn"
    local y = nn.Linear(2, 1)(tensor.tensor({{1, 2}}))
    assert.are.equal(tensor.float32, y.dtype)
  end)

  it("follows set_default_dtype and refuses non-float defaults", function()
    tensor.set_default_dtype(tensor.float64)
    local ok, e = pcall(function()
      assert.are.equal(tensor.float64, tensor.get_default_dtype())
      assert.are.equal(tensor.float64, tensor.tensor({1, 2}).dtype)
      assert.are.equal(tensor.float64, tensor.zeros(2).dtype)
      assert.are.equal(tensor.float64, tensor.full({2}, 1).dtype)
      assert.are.equal(tensor.float64, tensor.rand(2).dtype)
      assert.are.equal(tensor.float64, tensor.linspace(0, 1, 3).dtype)
      assert.are.equal(tensor.float64, (tensor.tensor({3LL}) * 0.5).dtype)
      assert.are.equal(1.5, (tensor.tensor({3LL}) * 0.5):item())
      assert.are.equal(tensor.int64, (tensor.tensor({3LL}) * 2).dtype)
      assert.are.equal(tensor.float64, (tensor.tensor({3LL}) / tensor.tensor({2LL})).dtype)
      assert.are.equal(tensor.float64, tensor.tensor({3LL}):exp().dtype)
      assert.are.equal(tensor.float64, tensor.tensor({3LL}):sin().dtype)
    end)
    tensor.set_default_dtype(tensor.float32)
    assert(ok, e)
    raises("only floating point dtypes", tensor.set_default_dtype, tensor.int64)
    assert.are.equal(tensor.float32, (tensor.tensor({3LL}) * 0.5).dtype)
  end)
end)

describe("argument parsing #unit", function()
  it("takes sizes as varargs, a table or a Size, and empty or all-nil options", function()
    local s = tensor.zeros(2, 3):size()
    assert.are.equal("Size([2, 3])", tostring(tensor.zeros({2, 3}):size()))
    assert.are.equal("Size([2, 3])", tostring(tensor.zeros(s):size()))
    assert.are.equal("Size([2, 3])", tostring(tensor.ones(2, 3, {}):size()))
    assert.are.equal("Size([2, 3])", tostring(tensor.ones({2, 3}, {dtype = nil}):size()))
    assert.are.equal("Size([2, 3])", tostring(tensor.rand(s, {}):size()))
    assert.are.equal("Size([2, 3])", tostring(tensor.zeros(2, 3, nil):size()))
    assert.are.equal(0, tensor.zeros({}):dim())
    assert.are.equal("Size([4, 6])", tostring(tensor.zeros(2, 3):new_zeros(4, 6):size()))
  end)

  it("makes zero-size tensors contiguous wherever the zero is", function()
    assert.is_true(tensor.ones(0, 0):is_contiguous())
    assert.is_true(tensor.ones(3, 0, 2):is_contiguous())
    assert.is_true(tensor.ones(4, 0):t():is_contiguous())
    assert.is_true(tensor.ones(0, 3):contiguous():is_contiguous())
  end)

  it("computes number-and-number calls and honours flatten's dims", function()
    assert.are.equal(3, tensor.add(0, 3):item())
    assert.are.equal(tensor.float32, tensor.add(0, 3).dtype)
    assert.are.equal(6, tensor.mul(2, 3):item())
    assert.are.equal(1, tensor.remainder(7, 3):item())
    local x = tensor.zeros(2, 3, 4, 5)
    assert.are.equal("Size([2, 12, 5])", tostring(x:flatten(2, 3):size()))
    assert.are.equal("Size([2, 60])", tostring(x:flatten(2):size()))
    assert.are.equal("Size([120])", tostring(x:flatten():size()))
    assert.are.equal("Size([6, 4, 5])", tostring(x:flatten(1, -3):size()))
    raises("comes after end_dim", x.flatten, x, 3, 2)
  end)

  it("names a missing method and the tensor's type", function()
    local x = tensor.zeros(2)
    local ok, e = pcall(function() return x:no_such_method() end)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("no method or field 'no_such_method'", 1, true), tostring(e))
    assert.truthy(tostring(e):find("float32", 1, true), tostring(e))
    assert.truthy(tostring(e):find("tensor_ops_spec.lua", 1, true), "the error points at the caller: " .. tostring(e))
  end)
end)

describe("tensor ops agree with numpy #unit", function()
  it("on float64, contiguous and transposed, and on the integer and bool dtypes", function()
    if not numpy_ok() then pending("python3-numpy is not installed") return end
    local dir = S.tmpdir .. "/ops"
    os.execute("mkdir -p " .. dir)
    tensor.manual_seed(21)
    local a, b = tensor.randn(5, 7, f64), tensor.randn(5, 7, f64)
    local ai = (tensor.randn(5, 7, f64) * 4):round():long() -- ties for the sorts
    local m = tensor.rand(5, 7, f64):gt(0.5)
    local idx = tensor.tensor({3LL, 1LL, 5LL, 3LL})
    local gidx = tensor.randint(1, 6, {4, 7})
    local perm = tensor.rand(5, 7):argsort(1) -- each column a permutation of 1..5
    local cls = tensor.tensor({2LL, 4LL, 1LL})
    local c3, d3 = tensor.randn(3, 4, 5, f64), tensor.randn(3, 5, 2, f64)
    local v1, v2 = tensor.randn(4, f64), tensor.randn(6, f64)
    for k, t in pairs({a = a, b = b, ai = ai, m = m, idx = idx, gidx = gidx, perm = perm, cls = cls, c3 = c3, d3 = d3,
                       v1 = v1, v2 = v2}) do
      tensor.save(t, ("%s/in_%s.npy"):format(dir, k))
    end
    -- name = {lua function, numpy expression}
    local cases = {
      cat = {function() return tensor.cat({a, b}, 2) end, "np.concatenate([a, b], 1)"},
      cat_t = {function() return tensor.cat({a:t(), b:t()}, 1) end, "np.concatenate([a.T, b.T], 0)"},
      stack = {function() return tensor.stack({a, b}, 2) end, "np.stack([a, b], 1)"},
      split1 = {function() return tensor.split(a, 3, 2)[3] end, "a[:, 6:7]"},
      splits = {function() return tensor.split(a, {2, 3}, 1)[2] end, "a[2:5]"},
      chunk = {function() return tensor.chunk(a, 2, 1)[2] end, "a[3:5]"},
      unbind = {function() return tensor.unbind(a, 2)[4] end, "a[:, 3]"},
      flip = {function() return a:flip(1) end, "np.flip(a, 0)"},
      flip2_t = {function() return a:t():flip(1, 2) end, "np.flip(a.T, (0, 1))"},
      roll = {function() return a:roll(2, 2) end, "np.roll(a, 2, 1)"},
      roll_flat = {function() return a:roll(-3) end, "np.roll(a, -3)"},
      ["repeat"] = {function() return a["repeat"](a, 2, 1, 3) end, "np.tile(a, (2, 1, 3))"},
      expand_as = {function() return a[1]:expand_as(a) end, "np.broadcast_to(a[0], a.shape)"},
      index_select = {function() return a:index_select(1, idx) end, "a[idx - 1]"},
      index_select_t = {function() return a:t():index_select(2, idx) end, "a.T[:, idx - 1]"},
      index_tensor = {function() return a[idx] end, "a[idx - 1]"},
      index_tensor_dim2 = {function() return a[{":", tensor.tensor({7LL, 2LL})}] end, "a[:, [6, 1]]"},
      index_mask = {function() return a[m] end, "a[m]"},
      index_rowmask = {function() return a[m[{":", 1}]] end, "a[m[:, 0]]"},
      gather = {function() return a:gather(1, gidx) end, "np.take_along_axis(a, gidx - 1, 0)"},
      gather_t = {function() return a:t():gather(2, gidx:t()) end, "np.take_along_axis(a.T, (gidx - 1).T, 1)"},
      scatter = {function() return tensor.zeros(5, 7, f64):scatter(1, perm, b) end,
        "z = np.zeros((5, 7)); np.put_along_axis(z, perm - 1, b, 0); r = z"},
      scatter_value = {function() return a:scatter(1, gidx, 9) end,
        "z = a.copy(); np.put_along_axis(z, gidx - 1, 9, 0); r = z"},
      scatter_add = {function() return a:scatter_add(1, gidx, b[{{1, 4}}]) end,
        "z = a.copy()\nfor i in range(4):\n  for j in range(7): z[gidx[i, j] - 1, j] += b[i, j]\nr = z"},
      index_add = {function() return a:index_add(1, idx, b[{{1, 4}}]) end,
        "z = a.copy(); np.add.at(z, idx - 1, b[:4]); r = z"},
      masked_fill = {function() return a:masked_fill(m, -2) end, "np.where(m, -2.0, a)"},
      masked_fill_t = {function() return a:t():masked_fill(m:t(), 3) end, "np.where(m.T, 3.0, a.T)"},
      masked_select = {function() return a:masked_select(m) end, "a[m]"},
      where = {function() return tensor.where(m, a, b) end, "np.where(m, a, b)"},
      where_scalar = {function() return tensor.where(m, a, 0) end, "np.where(m, a, 0.0)"},
      where_bcast = {function() return tensor.where(m, a[1], b:t():t()) end, "np.where(m, a[0], b)"},
      nonzero = {function() return tensor.nonzero(m) end, "np.argwhere(m) + 1"},
      clamp = {function() return a:clamp(-0.5, 0.7) end, "np.clip(a, -0.5, 0.7)"},
      clamp_t = {function() return a:t():clamp({min = 0}) end, "np.clip(a.T, 0, None)"},
      floor = {function() return (a * 3):floor() end, "np.floor(a * 3)"},
      ceil = {function() return (a * 3):ceil() end, "np.ceil(a * 3)"},
      round = {function() return (a * 3):round() end, "np.round(a * 3)"},
      round_half = {function() return tensor.tensor({0.5, 1.5, 2.5, -0.5}, f64):round() end, "np.round([0.5, 1.5, 2.5, -0.5])"},
      remainder = {function() return a % b end, "np.mod(a, b)"},
      remainder_scalar = {function() return (a * 5) % 3 end, "np.mod(a * 5, 3)"},
      remainder_int = {function() return ai % 3LL end, "np.mod(ai, 3)"},
      remainder_negdiv = {function() return ai:remainder(-4LL) end, "np.mod(ai, -4)"},
      sign = {function() return ai:double():sign() end, "np.sign(ai).astype(float)"},
      sin = {function() return a:sin() end, "np.sin(a)"},
      cos_t = {function() return a:t():cos() end, "np.cos(a.T)"},
      log1p = {function() return a:abs():log1p() end, "np.log1p(np.abs(a))"},
      expm1 = {function() return a:expm1() end, "np.expm1(a)"},
      rsqrt = {function() return (a:abs() + 0.1):rsqrt() end, "1 / np.sqrt(np.abs(a) + 0.1)"},
      var = {function() return a:var() end, "np.var(a, ddof=1)"},
      var_dim = {function() return a:var(2) end, "np.var(a, 1, ddof=1)"},
      var_t = {function() return a:t():var(1, false, true) end, "np.var(a.T, 0, keepdims=True)"},
      std = {function() return a:std(1) end, "np.std(a, 0, ddof=1)"},
      norm = {function() return a:norm() end, "np.linalg.norm(a)"},
      norm1 = {function() return a:norm(1, 2) end, "np.abs(a).sum(1)"},
      norm3 = {function() return a:norm(3) end, "(np.abs(a) ** 3).sum() ** (1 / 3)"},
      norminf = {function() return a:norm(math.huge, 1) end, "np.abs(a).max(0)"},
      logsumexp = {function() return a:logsumexp(2) end, "np.log(np.exp(a).sum(1))"},
      logsumexp_t = {function() return (a * 300):t():logsumexp(1, true) end,
        "x = (a * 300).T; mx = x.max(0, keepdims=True); r = mx + np.log(np.exp(x - mx).sum(0, keepdims=True))"},
      cumsum = {function() return a:cumsum(1) end, "np.cumsum(a, 0)"},
      cumsum_t = {function() return a:t():cumsum(2) end, "np.cumsum(a.T, 1)"},
      cumprod = {function() return a:cumprod(2) end, "np.cumprod(a, 1)"},
      cumsum_int = {function() return ai:cumsum(2) end, "np.cumsum(ai, 1)"},
      sort = {function() return (a:sort(2)) end, "np.sort(a, 1)"},
      sort_idx = {function() return select(2, a:sort(2)) end, "np.argsort(a, 1, kind='stable') + 1"},
      sort_desc_t = {function() return (a:t():sort(1, true)) end, "-np.sort(-a.T, 0)"},
      argsort_ties = {function() return ai:argsort(2) end, "np.argsort(ai, 1, kind='stable') + 1"},
      argsort_ties_desc = {function() return ai:argsort(1, true) end, "np.argsort(-ai, 0, kind='stable') + 1"},
      sort_nan = {function() return (tensor.tensor({3, 0 / 0, -1, 2}, f64):sort()) end, "np.sort([3, np.nan, -1, 2])"},
      topk = {function() return (a:topk(3, 2)) end, "-np.sort(-a, 1)[:, :3]"},
      topk_idx = {function() return select(2, a:topk(2, 1, false)) end, "np.argsort(a, 0, kind='stable')[:2] + 1"},
      all = {function() return m:all(2) end, "m.all(1)"},
      any = {function() return m:any(1) end, "m.any(0)"},
      all_float = {function() return a:all() end, "np.array(a.all())"},
      one_hot = {function() return tensor.one_hot(cls, 5) end, "np.eye(5, dtype=np.int64)[cls - 1]"},
      outer = {function() return tensor.outer(v1, v2) end, "np.outer(v1, v2)"},
      bmm = {function() return tensor.bmm(c3, d3) end, "c3 @ d3"},
      linspace = {function() return tensor.linspace(-1, 2, 7, f64) end, "np.linspace(-1, 2, 7)"},
      logspace = {function() return tensor.logspace(0, 3, 4, 2, f64) end, "np.logspace(0, 3, 4, base=2)"},
      eye = {function() return tensor.eye(3, 5, f64) end, "np.eye(3, 5)"},
      einsum_mm = {function() return tensor.einsum("ij,jk->ik", a, b:t()) end, "np.einsum('ij,jk->ik', a, b.T)"},
      einsum_bmm = {function() return tensor.einsum("bij,bjk->bik", c3, d3) end, "np.einsum('bij,bjk->bik', c3, d3)"},
      einsum_t = {function() return tensor.einsum("ij->ji", a) end, "np.einsum('ij->ji', a)"},
      einsum_dot = {function() return tensor.einsum("i,i->", v1, v1) end, "np.einsum('i,i->', v1, v1)"},
      einsum_rowdot = {function() return tensor.einsum("ij,ij->i", a, b) end, "np.einsum('ij,ij->i', a, b)"},
      einsum_implicit = {function() return tensor.einsum("ij,kj", a, b) end, "np.einsum('ij,kj', a, b)"},
      einsum_outer = {function() return tensor.einsum("i,j->ij", v1, v2) end, "np.einsum('i,j->ij', v1, v2)"},
      einsum_three = {function() return tensor.einsum("ij,jk,kl->il", a, b:t(), a) end,
        "np.einsum('ij,jk,kl->il', a, b.T, a)"},
      einsum_sum = {function() return tensor.einsum("bij,bjk->k", c3, d3) end, "np.einsum('bij,bjk->k', c3, d3)"},
      einsum_trace = {function() return tensor.einsum("ii", a[{{1, 5}, {1, 5}}]) end, "np.einsum('ii', a[:5, :5])"},
      einsum_diag = {function() return tensor.einsum("ii->i", a[{{1, 5}, {1, 5}}]) end, "np.einsum('ii->i', a[:5, :5])"},
      einsum_bdiag = {function() return tensor.einsum("bii->b", c3[{":", {1, 4}, {1, 4}}]) end, "np.einsum('bii->b', c3[:, :4, :4])"},
      diagonal = {function() return a:diagonal() end, "np.diagonal(a)"},
      diagonal_off = {function() return a:diagonal(2) end, "np.diagonal(a, 2)"},
      diagonal_neg_t = {function() return a:t():diagonal(-1) end, "np.diagonal(a.T, -1)"},
      diagonal_3d = {function() return c3:diagonal(0, 1, 3) end, "np.diagonal(c3, 0, 0, 2)"},
      trace = {function() return a[{{1, 5}, {1, 5}}]:trace() end, "np.trace(a[:5, :5])"},
    }
    -- every dtype the dtype-generic ops take
    local DT = {int64 = "np.int64", int32 = "np.int32", uint8 = "np.uint8", bool = "bool", float32 = "np.float32"}
    for name, np_dt in pairs(DT) do
      local function x() local v = name == "uint8" and ai:abs() or ai; return v:to(tensor[name]) end
      local npx = ("(np.abs(ai) if '%s' == 'uint8' else ai).astype(%s)"):format(name, np_dt)
      cases["cat_" .. name] = {function() return tensor.cat({x(), x():flip(1)}, 1) end, ("np.concatenate([%s, np.flip(%s, 0)], 0)"):format(npx, npx)}
      cases["index_select_" .. name] = {function() return x():t():index_select(2, idx) end, ("%s.T[:, idx - 1]"):format(npx)}
      cases["gather_" .. name] = {function() return x():gather(1, gidx) end, ("np.take_along_axis(%s, gidx - 1, 0)"):format(npx)}
      cases["masked_fill_" .. name] = {function() return x():masked_fill(m, 1) end, ("np.where(m, 1, %s).astype(%s)"):format(npx, np_dt)}
      cases["where_" .. name] = {function() return tensor.where(m, x(), x():flip(2)) end, ("np.where(m, %s, np.flip(%s, 1))"):format(npx, npx)}
      cases["masked_select_" .. name] = {function() return x():masked_select(m) end, ("%s[m]"):format(npx)}
      if name ~= "bool" then
        cases["sort_" .. name] = {function() return (x():sort(2)) end, ("np.sort(%s, 1)"):format(npx)}
        cases["argsort_" .. name] = {function() return x():t():argsort(1) end, ("np.argsort(%s.T, 0, kind='stable') + 1"):format(npx)}
        cases["cumsum_" .. name] = {function() return x():cumsum(1) end, ("np.cumsum(%s, 0%s)"):format(npx, name == "float32" and "" or ", dtype=np.int64")}
        cases["clamp_" .. name] = {function() return x():clamp(1, 3) end, ("np.clip(%s, 1, 3)"):format(npx)}
        cases["scatter_add_" .. name] = {function() return x():scatter_add(1, perm, x()) end,
          ("z = %s.copy()\nfor i in range(5):\n  for j in range(7): z[perm[i, j] - 1, j] += %s[i, j]\nr = z"):format(npx, npx)}
      end
    end
    local lines = {"import numpy as np", ("d = %q"):format(dir)}
    for _, k in ipairs({"a", "b", "ai", "m", "idx", "gidx", "perm", "cls", "c3", "d3", "v1", "v2"}) do
      lines[#lines + 1] = ("%s = np.load(d + '/in_%s.npy')"):format(k, k)
    end
    local names = {}
    for name in pairs(cases) do names[#names + 1] = name end
    table.sort(names)
    for _, name in ipairs(names) do
      local expr = cases[name][2]
      if expr:find("r = ", 1, true) then lines[#lines + 1] = expr
      else lines[#lines + 1] = "r = " .. expr end
      lines[#lines + 1] = ("np.save(d + '/out_%s.npy', np.asarray(r))"):format(name)
    end
    local script = S.write(table.concat(lines, "\n") .. "\n", "ops_numpy.py")
    assert.is_true(os.execute(PY .. " " .. script) == 0, "the numpy script failed")
    for _, name in ipairs(names) do
      local got = cases[name][1]()
      local want = tensor.load(("%s/out_%s.npy"):format(dir, name))
      if want.dtype == tensor.float64 and got.dtype == tensor.float32 then want = want:float() end
      local tol = got.dtype == tensor.float32 and 1e-6 or 1e-11
      assert_close(name, got, want, tol)
      if not want.dtype.is_floating_point and name ~= "sign" then
        assert.are.equal(want.dtype == tensor.int32 and tensor.int32 or want.dtype, got.dtype, name .. ": dtype")
      end
    end
  end)

  it("gives the gradients numpy computes (indexing, ordering, scans, reductions)", function()
    if not numpy_ok() then pending("python3-numpy is not installed") return end
    local dir = S.tmpdir .. "/opsgrad"
    os.execute("mkdir -p " .. dir)
    tensor.manual_seed(5)
    local a = tensor.randn(5, 7, f64)
    local w1, w2 = tensor.randn(6, 7, f64), tensor.randn(4, 7, f64)
    local idx = tensor.tensor({2LL, 2LL, 5LL, 1LL, 2LL, 4LL})
    local gidx = tensor.randint(1, 6, {4, 7})
    for k, t in pairs({a = a, w1 = w1, w2 = w2, idx = idx, gidx = gidx}) do tensor.save(t, ("%s/%s.npy"):format(dir, k)) end
    local script = S.write(([[
import numpy as np
d = %q
L = lambda k: np.load(d + '/' + k + '.npy')
a, w1, w2, idx, gidx = L('a'), L('w1'), L('w2'), L('idx'), L('gidx')
g = np.zeros_like(a); np.add.at(g, idx - 1, w1); np.save(d + '/g_isel.npy', g)
g = np.zeros_like(a)
for i in range(4):
  for j in range(7): g[gidx[i, j] - 1, j] += w2[i, j]
np.save(d + '/g_gather.npy', g)
np.save(d + '/g_cumsum.npy', np.flip(np.cumsum(np.flip(w1[:5], 0), 0), 0))
w = w1[:5]
g = np.zeros_like(a); np.put_along_axis(g, np.argsort(a, 1, kind='stable'), w, 1); np.save(d + '/g_sort.npy', g)
np.save(d + '/g_flip.npy', np.flip(w, 1))
np.save(d + '/g_roll.npy', np.roll(w, -2, 1))
np.save(d + '/g_var.npy', 2 * (a - a.mean(1, keepdims=True)) / 6 * w[:, :1])
e = np.exp(a - a.max(1, keepdims=True)); np.save(d + '/g_lse.npy', e / e.sum(1, keepdims=True) * w[:, :1])
out = np.cumprod(a, 1); np.save(d + '/g_cumprod.npy', np.flip(np.cumsum(np.flip(w * out, 1), 1), 1) / a)
m = a > 0; g = np.zeros_like(a); g[m] = w1.reshape(-1)[:m.sum()]; np.save(d + '/g_mselect.npy', g)
np.save(d + '/g_where.npy', np.where(m, w, 0))
np.save(d + '/g_norm.npy', a / np.linalg.norm(a) * w[0, 0])
np.save(d + '/g_clamp.npy', np.where((a >= -0.5) & (a <= 0.5), w, 0))
]]):format(dir), "opsgrad.py")
    assert.is_true(os.execute(PY .. " " .. script) == 0)
    local function grad_of(f, w)
      local x = a:clone()
      x.requires_grad = true
      (f(x) * w):sum():backward()
      return x.grad
    end
    assert_close("index_select grad", grad_of(function(x) return x:index_select(1, idx) end, w1), tensor.load(dir .. "/g_isel.npy"))
    assert_close("t[idx] grad", grad_of(function(x) return x[idx] end, w1), tensor.load(dir .. "/g_isel.npy"))
    assert_close("gather grad", grad_of(function(x) return x:gather(1, gidx) end, w2), tensor.load(dir .. "/g_gather.npy"))
    assert_close("cumsum grad", grad_of(function(x) return x:cumsum(1) end, w1[{{1, 5}}]), tensor.load(dir .. "/g_cumsum.npy"))
    local w = w1[{{1, 5}}]
    local L = function(k) return tensor.load(dir .. "/g_" .. k .. ".npy") end
    assert_close("sort grad", grad_of(function(x) return (x:sort(2)) end, w), L("sort"))
    assert_close("flip grad", grad_of(function(x) return x:flip(2) end, w), L("flip"))
    assert_close("roll grad", grad_of(function(x) return x:roll(2, 2) end, w), L("roll"))
    assert_close("var grad", grad_of(function(x) return x:var(2, true, true) end, w[{":", {1, 1}}]), L("var"), 1e-10)
    assert_close("logsumexp grad", grad_of(function(x) return x:logsumexp(2, true) end, w[{":", {1, 1}}]), L("lse"), 1e-10)
    assert_close("cumprod grad", grad_of(function(x) return x:cumprod(2) end, w), L("cumprod"), 1e-9)
    local m = a:gt(0)
    local nsel = m:sum():item()
    assert_close("masked_select grad", grad_of(function(x) return x:masked_select(m) end,
      w1:reshape(-1):narrow(1, 1, nsel)), L("mselect"))
    assert_close("where grad", grad_of(function(x) return tensor.where(m, x, 0) end, w), L("where"))
    assert_close("norm grad", grad_of(function(x) return x:norm() end, w[1][1]), L("norm"), 1e-10)
    assert_close("clamp grad", grad_of(function(x) return x:clamp(-0.5, 0.5) end, w), L("clamp"))
  end)
end)

describe("tensor op gradients #unit", function()
  local function r(...) return tensor.randn({...}, f64) end
  before_each(function() tensor.manual_seed(9) end)

  it("match finite differences for joining, splitting and reordering", function()
    gradcheck("cat", function(a, b) return tensor.cat({a, b}, 2) end, {r(3, 2), r(3, 4)})
    gradcheck("cat of a transpose", function(a, b) return tensor.cat({a:t(), b}, 1) end, {r(4, 3), r(2, 4)})
    gradcheck("stack", function(a, b) return tensor.stack({a, b}, 3) end, {r(2, 3), r(2, 3)})
    gradcheck("split", function(a) local p = tensor.split(a, 2, 2); return p[1] * 2 + p[2] end, {r(3, 4)})
    gradcheck("chunk", function(a) local p = a:chunk(3, 1); return tensor.cat({p[3], p[1]}, 1) end, {r(6, 2)})
    gradcheck("unbind", function(a) local p = a:unbind(2); return p[1] * p[3] end, {r(3, 4)})
    gradcheck("flip", function(a) return a:t():flip(1) end, {r(3, 4)})
    gradcheck("roll", function(a) return a:roll({1, -2}, {1, 2}) end, {r(3, 4)})
    gradcheck("repeat", function(a) return a["repeat"](a, 2, 3) end, {r(2, 3)})
    gradcheck("expand_as", function(a, b) return a:expand_as(b) * b end, {r(1, 3), r(4, 3)})
    gradcheck("sort", function(a) return (a:sort(2, true)) end, {r(3, 5)})
    gradcheck("topk", function(a) return (a:t():topk(2, 1)) end, {r(3, 5)})
  end)

  it("match finite differences for indexing", function()
    local idx = tensor.tensor({3LL, 1LL, 3LL})
    local gidx = tensor.tensor({{1LL, 2LL, 1LL}, {3LL, 3LL, 2LL}})
    local perm = tensor.tensor({{2LL, 1LL, 3LL}, {3LL, 2LL, 1LL}})
    local m = tensor.tensor({{true, false, true}, {false, false, true}, {true, true, false}})
    gradcheck("index_select", function(a) return a:index_select(1, idx) end, {r(3, 3)})
    gradcheck("index_select strided", function(a) return a:t():index_select(2, idx) end, {r(3, 3)})
    gradcheck("gather", function(a) return a:gather(1, gidx) end, {r(3, 3)})
    gradcheck("scatter", function(a, s) return a:scatter(1, perm, s) end, {r(3, 3), r(2, 3)})
    gradcheck("scatter_add", function(a, s) return a:scatter_add(1, gidx, s) end, {r(3, 3), r(2, 3)})
    gradcheck("index_add", function(a, s) return a:index_add(1, idx, s, {alpha = 2}) end, {r(3, 3), r(3, 3)})
    gradcheck("masked_fill", function(a) return a:masked_fill(m, 0.5) end, {r(3, 3)})
    gradcheck("masked_select", function(a) return a:masked_select(m) end, {r(3, 3)})
    gradcheck("masked_select broadcast", function(a) return a:masked_select(m) end, {r(1, 3)})
    gradcheck("where", function(a, b) return tensor.where(m, a, b) end, {r(3, 3), r(3)})
    gradcheck("t[idx]", function(a) return a[idx] end, {r(3, 2)})
    gradcheck("t[{':', idx}]", function(a) return a[{":", idx}] end, {r(2, 3)})
    gradcheck("t[mask]", function(a) return a[m] end, {r(3, 3)})
    gradcheck("t[2d idx]", function(a) return a[gidx] end, {r(3, 2)})
  end)

  it("match finite differences for elementwise ops, reductions and scans", function()
    gradcheck("clamp", function(a) return a:clamp(-0.3, 0.4) end, {r(8)})
    gradcheck("clamp tensors", function(a, lo) return a:clamp(lo, nil) end, {r(2, 4), r(4)})
    gradcheck("floor", function(a) return (a * 3):floor() + a end, {r(5)})
    gradcheck("remainder", function(a, b) return a % (b:abs() + 0.5) end, {r(6), r(6)})
    gradcheck("sign", function(a) return a:sign() * a end, {r(5)})
    gradcheck("sin", function(a) return a:sin() end, {r(5)})
    gradcheck("cos", function(a) return a:t():cos() end, {r(2, 3)})
    gradcheck("log1p", function(a) return a:abs():log1p() end, {r(5)})
    gradcheck("expm1", function(a) return a:expm1() end, {r(5)})
    gradcheck("rsqrt", function(a) return (a:abs() + 0.5):rsqrt() end, {r(5)})
    gradcheck("var", function(a) return a:var(2) end, {r(3, 4)})
    gradcheck("std", function(a) return a:std() end, {r(3, 4)})
    gradcheck("norm", function(a) return a:norm() end, {r(3, 4)})
    gradcheck("norm p=3 dim", function(a) return a:norm(3, 1) end, {r(3, 4)})
    gradcheck("norm dim", function(a) return a:norm(2, 2) end, {r(3, 4)})
    gradcheck("norm dim keepdim", function(a) return a:norm(2, 1, true) end, {r(3, 4)})
    local z = tensor.zeros(3, f64)
    z.requires_grad = true
    z:norm():backward()
    assert.are.same({0, 0, 0}, z.grad:totable()) -- the subgradient at 0, not NaN
    gradcheck("logsumexp", function(a) return a:logsumexp(2) end, {r(3, 4)})
    gradcheck("cumsum", function(a) return a:cumsum(2) end, {r(3, 4)})
    gradcheck("cumprod", function(a) return a:cumprod(1) end, {r(4, 3)})
    local z = r(2, 4)
    z[1][2] = 0
    z[2][1] = 0
    z[2][3] = 0
    gradcheck("cumprod with zeros", function(a) return a:cumprod(2) end, {z})
    gradcheck("outer", function(a, b) return tensor.outer(a, b) end, {r(3), r(4)})
    gradcheck("bmm", function(a, b) return tensor.bmm(a, b) end, {r(2, 3, 4), r(2, 4, 2)})
    gradcheck("einsum", function(a, b, c) return tensor.einsum("ij,jk,k->i", a, b, c) end, {r(2, 3), r(3, 4), r(4)})
    gradcheck("einsum trace", function(a) return tensor.einsum("ii", a) end, {r(3, 3)})
    gradcheck("diagonal", function(a) return a:diagonal(1) end, {r(3, 4)})
    -- ops that promote hand each input a gradient of its own dtype
    local x32 = tensor.randn(2, 3, {requires_grad = true})
    local x64 = tensor.randn(2, 3, {dtype = tensor.float64, requires_grad = true})
    tensor.cat({x32, x64}):sum():backward()
    tensor.where(x32:gt(0), x32, x64):sum():backward()
    assert.are.equal(tensor.float32, x32.grad.dtype)
    assert.are.equal(tensor.float64, x64.grad.dtype)
  end)
end)

describe("indexing with tensors #unit", function()
  it("assigns through int64 indices and bool masks", function()
    local x = tensor.zeros(4, 3)
    x[tensor.tensor({2LL, 4LL})] = 7
    assert.are.same({{0, 0, 0}, {7, 7, 7}, {0, 0, 0}, {7, 7, 7}}, x:totable())
    x[{":", tensor.tensor({1LL})}] = tensor.tensor({{1}, {2}, {3}, {4}})
    assert.are.same({{1, 0, 0}, {2, 7, 7}, {3, 0, 0}, {4, 7, 7}}, x:totable())
    x[x:gt(5)] = -1
    assert.are.same({{1, 0, 0}, {2, -1, -1}, {3, 0, 0}, {4, -1, -1}}, x:totable())
    x[x:lt(0)] = tensor.tensor({10, 20, 30, 40})
    assert.are.same({{1, 0, 0}, {2, 10, 20}, {3, 0, 0}, {4, 30, 40}}, x:totable())
    x[tensor.tensor({true, false, false, true})] = 0
    assert.are.same({{0, 0, 0}, {2, 10, 20}, {3, 0, 0}, {0, 0, 0}}, x:totable())
    x[{2, tensor.tensor({3LL, 1LL})}] = tensor.tensor({5, 6})
    assert.are.same({6, 10, 5}, x[2]:totable())
    -- negative indices count from the end, as in PyTorch
    assert.are.same({0, 0, 0}, x[tensor.tensor({-1LL})]:view(-1):totable())
  end)

  it("names a bad index, a bad mask and a bad dtype", function()
    local x = tensor.zeros(4, 3)
    raises("index 5 is out of bounds for dimension 1 with size 4", function() return x[tensor.tensor({5LL})] end)
    raises("index_select: index 0 is out of bounds", function() return x:index_select(1, tensor.tensor({0LL})) end)
    raises("gather: index 9 is out of bounds for dimension 2 with size 3", function()
      return x:gather(2, tensor.tensor({{9LL}})) end)
    raises("the index must be an int64", function() return x:index_select(1, tensor.tensor({1.0})) end)
    raises("an index tensor must be int64 (positions) or bool", function() return x[tensor.tensor({1.0})] end)
    raises("the mask's shape Size([3]) does not match", function() return x[tensor.tensor({true, true, false})] end)
    raises("the mask must be a bool tensor", function() return x:masked_fill(tensor.zeros(4, 3), 1) end)
    raises("scatter: the index (shape [5, 1]) is larger than the input (shape [4, 3]) in dimension 1", function()
      return x:scatter(2, tensor.ones(5, 1, {dtype = tensor.int64}), 0) end)
    raises("cat: sizes must match except in dimension 1: tensor 2 has shape Size([2, 2])", function()
      return tensor.cat({x, tensor.zeros(2, 2)}) end)
    raises("cat: tensor 2 has 1 dimensions but tensor 1 has 2", function() return tensor.cat({x, tensor.zeros(3)}) end)
    raises("stack: every tensor must have the same shape", function() return tensor.stack({x, x:t()}) end)
    raises("split: the sizes {1, 2} add up to 3 but dimension 1 has size 4", function() return x:split({1, 2}) end)
    raises("topk: k must be an integer in 0..3", function() return x:topk(4) end)
    raises("einsum: operand 2 has 2 dimensions but its subscripts 'j' name 1", function()
      return tensor.einsum("ij,j->i", x, x) end)
    raises("einsum: subscript 'j' has size 3 in one operand and 4 in another", function()
      return tensor.einsum("ij,jk->ik", x, x) end)
    raises("bmm: expected two 3-dimensional tensors, got shapes Size([4, 3]) and Size([4, 3])", function()
      return tensor.bmm(x, x) end)
    raises("remainder: integer division by zero", function()
      return tensor.tensor({3LL}) % tensor.tensor({0LL}) end)
    raises("one_hot: classes must be in 1..3", function() return tensor.one_hot(tensor.tensor({4LL}), 3) end)
    raises("multinomial: cannot draw 4 samples from 3 categories without replacement", function()
      return tensor.multinomial(tensor.ones(3), 4) end)
    raises("bernoulli: probability 2 at element 1 is not in [0, 1]", function()
      return tensor.bernoulli(tensor.tensor({2})) end)
    raises("randint: expected low < high", function() return tensor.randint(3, 3, {2}) end)
  end)
end)

describe("strided copies #unit", function()
  it("copy every permuted layout of every dtype element for element (the tiled path included)", function()
    local function eq(u, w)
      if type(u) == "table" then
        for i = 1, #u do if not eq(u[i], w[i]) then return false end end
        return #u == #w
      end
      return u == w
    end
    tensor.manual_seed(2)
    for _, dt in ipairs({tensor.float32, tensor.float64, tensor.int32, tensor.int64, tensor.uint8, tensor.bool}) do
      for _, shp in ipairs({{37, 129}, {100, 65}, {8, 8}, {3, 70, 41}, {64, 33, 2}, {0, 5}}) do
        local x = (tensor.randn(shp) * 50):to(dt)
        local perms = #shp == 2 and {{2, 1}} or {{3, 2, 1}, {2, 1, 3}, {1, 3, 2}, {3, 1, 2}}
        for _, p in ipairs(perms) do
          local v = x:permute(p)
          local name = ("%s %s permuted %s"):format(dt.name, table.concat(shp, "x"), table.concat(p, ","))
          -- totable reads element by element, independent of the copy engine
          assert.is_true(eq(v:totable(), v:contiguous():totable()), name)
          assert.is_true(eq(v:totable(), v:clone():totable()), name .. " (clone)")
          local into = tensor.zeros(v:size(), {dtype = dt})
          into:copy_(v)
          assert.is_true(eq(v:totable(), into:totable()), name .. " (copy_)")
          -- a slice of a permuted view: strides that are not the sizes' products
          if v:size(1) > 2 then
            local s = v:narrow(1, 2, v:size(1) - 2)
            assert.is_true(eq(s:totable(), s:contiguous():totable()), name .. " (sliced)")
          end
        end
      end
    end
  end)

  it("transpose a float32 matrix larger than the caches (streamed stores, ragged edges, unaligned rows)", function()
    -- 1100 x 2061 float32 is 9 MB: above the size written around the caches, and
    -- neither side a multiple of the 16 x 16 blocks. Values are their own flat index
    -- (exact in float32), so the expected transpose is a broadcast sum, computed
    -- without the copy engine.
    local a, b = 1100, 2061
    local x = tensor.arange(0, a * b):view(a, b)
    local want = tensor.arange(0, b):view(b, 1) + tensor.arange(0, a):view(1, a) * b
    assert.are.equal(0, (x:t():contiguous() - want):abs():max():item())
    -- a destination whose rows do not start on 64-byte lines takes ordinary stores
    local wide = tensor.zeros(b, a + 3)
    local into = wide:narrow(2, 2, a)
    into:copy_(x:t())
    assert.are.equal(0, (into - want):abs():max():item())
    assert.are.equal(0, wide:narrow(2, 1, 1):abs():sum():item() + wide:narrow(2, a + 2, 2):abs():sum():item())
  end)
end)

describe("large gathers #unit", function()
  it("checked in every thread: the same values as the int32 path, the first bad index named", function()
    tensor.manual_seed(9)
    local n = 200000
    local src = tensor.randn(n)
    local idx = tensor.randint(1, n + 1, {n})
    idx[5] = -1 -- from the end, as PyTorch
    local got = src:gather(1, idx)
    assert.is_true(got:equal(src:gather(1, idx:int())))
    assert.are.equal(src[n]:item(), got[5]:item())
    -- two bad indices far apart (different threads' blocks): the first is named
    idx[150001], idx[70001] = n + 7, 0
    local ok, e = pcall(src.gather, src, 1, idx)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("gather: index 0 is out of bounds for dimension 1 with size 200000", 1, true),
      tostring(e))
  end)
end)

describe("large scatters #unit", function()
  it("split across threads give the serial answer (last store wins, every add counted)", function()
    tensor.manual_seed(8)
    for _, d in ipairs({1, 2}) do
      local R, C = 300, 400
      local idx = tensor.randint(1, (d == 1 and R or C) + 1, {R, C})
      local src = tensor.randn(R, C, f64)
      local got_set = tensor.zeros(R, C, f64):scatter(d, idx, src):totable()
      local got_add = tensor.zeros(R, C, f64):scatter_add(d, idx, src):totable()
      local it, st = idx:totable(), src:totable()
      local want_set, want_add = {}, {}
      for i = 1, R do want_set[i], want_add[i] = {}, {} for j = 1, C do want_set[i][j], want_add[i][j] = 0, 0 end end
      for i = 1, R do
        for j = 1, C do
          local ti, tj = i, j
          if d == 1 then ti = it[i][j] else tj = it[i][j] end
          want_set[ti][tj] = st[i][j]
          want_add[ti][tj] = want_add[ti][tj] + st[i][j]
        end
      end
      for i = 1, R do
        for j = 1, C do
          assert.are.equal(want_set[i][j], got_set[i][j], ("scatter dim %d at %d,%d"):format(d, i, j))
          assert.is_true(math.abs(want_add[i][j] - got_add[i][j]) < 1e-9, ("scatter_add dim %d at %d,%d"):format(d, i, j))
        end
      end
    end
  end)
end)

describe("random ops #unit", function()
  it("repeat under manual_seed and draw what they promise", function()
    tensor.manual_seed(4)
    local p1, i1 = tensor.randperm(10), tensor.randint(-3, 4, {1000})
    tensor.manual_seed(4)
    assert.is_true(p1:equal(tensor.randperm(10)))
    assert.is_true(i1:equal(tensor.randint(-3, 4, {1000})))
    assert.are.same({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, (p1:sort()):totable())
    assert.are.equal(-3, i1:min():item())
    assert.are.equal(3, i1:max():item())
    local b = tensor.bernoulli(tensor.full({20000}, 0.25, f64))
    assert.is_true(math.abs(b:mean():item() - 0.25) < 0.02)
    local w = tensor.tensor({{0, 1, 3}, {1, 0, 0}})
    local draws = tensor.multinomial(w, 4000, true)
    assert.are.equal("Size([2, 4000])", tostring(draws:size()))
    assert.are.equal(0, draws[1]:eq(1LL):sum():item()) -- a zero weight is never drawn
    assert.is_true(math.abs(draws[1]:eq(3LL):double():mean():item() - 0.75) < 0.03)
    assert.is_true(draws[2]:eq(1LL):all():item())
    local nr = tensor.multinomial(tensor.ones(5), 5)
    assert.are.same({1, 2, 3, 4, 5}, (nr:sort()):totable())
  end)
end)

describe("in-place ops #unit", function()
  it("change the tensor they are called on and move its version once per write", function()
    local x = tensor.zeros(3, 2)
    local idx = tensor.tensor({{1LL, 2LL}})
    local ops = {
      function() x:scatter_(1, idx, 1) end,
      function() x:scatter_add_(1, idx, tensor.ones(1, 2)) end,
      function() x:index_add_(1, tensor.tensor({3LL}), tensor.ones(1, 2)) end,
      function() x:index_fill_(2, tensor.tensor({1LL}), 5) end,
      function() x:masked_fill_(x:gt(4), 4) end,
      function() x:masked_scatter_(x:eq(0), tensor.tensor({8, 9})) end,
      function() x:clamp_(0, 8) end,
      function() x:sin_() end,
      function() x:remainder_(2) end,
      function() x[tensor.tensor({1LL})] = 0 end,
      -- and the core in-place families (math.lua, indexing.lua)
      function() x:add_(1) end,
      function() x:exp_() end,
      function() x:copy_(tensor.ones(3, 2)) end,
      function() x:fill_(2) end,
      function() x:zero_() end,
      function() x[1] = 3 end,
      function() x[{2, 1}] = 4LL end,
    }
    for i, op in ipairs(ops) do
      local v = x._version
      op()
      assert.are.equal(v + 1, x._version, "op " .. i)
    end
    assert.are.same({{3, 3}, {4, 0}, {0, 0}}, x:totable())
  end)

  it("follow autograd's one in-place rule: refused on a leaf that requires grad, recorded on other tensors", function()
    -- (spec/autograd_inplace_spec.lua checks the rule for every in-place op)
    local w = tensor.randn(3, 2, {requires_grad = true})
    local LEAF = "a leaf Variable that requires grad is being used in an in-place operation"
    raises(LEAF .. " (masked_fill_)", function() return w:masked_fill_(w:gt(0), 0) end)
    raises(LEAF .. " (index_add_)", function() return w:index_add_(1, tensor.tensor({1LL}), tensor.ones(1, 2)) end)
    raises(LEAF .. " (index assignment)", function() w[tensor.tensor({1LL})] = 0 end)
    -- on a result it is recorded: the gradient is the out-of-place op's
    local y = w * 2
    y:sin_()
    assert.are.equal("<SinBackward0>", tostring(y.grad_fn))
    y:sum():backward()
    assert.is_true(w.grad:allclose((w:detach() * 2):cos() * 2))
    w.grad = nil
    local z = w * 1
    z[tensor.tensor({2LL})] = 0
    z:sum():backward()
    assert.are.same({{1, 1}, {0, 0}, {1, 1}}, w.grad:totable())
    -- under no_grad they run (optimizer-style updates)
    tensor.no_grad(function() w:masked_fill_(w:gt(0), 0) end)
    assert.is_true(w:le(0):all():item())
  end)
end)
