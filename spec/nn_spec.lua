-- nn's behaviour beyond parity with PyTorch (spec/nn_parity_spec.lua): the
-- Module system (registries, field assignment, state_dict names, strict
-- loading, .npz files numpy reads, printing, train/eval, zero_grad, to,
-- deepcopy, containers), bad input naming the layer and the shapes, PyTorch's
-- default initialisations, finite-difference gradient checks of every layer in
-- float64, optim and data behaviour, a small training run that must reach a
-- stated loss, and a module sent over RPC with its parameters.
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local S = require "spec.support"

local f64 = {dtype = tensor.float64}
local PY = "/usr/bin/python3"
local function numpy_ok() return os.execute(PY .. " -c 'import numpy' 2>/dev/null") == 0 end

local function raises(pattern, fn, ...)
  local ok, e = pcall(fn, ...)
  assert.is_false(ok, "expected an error matching " .. pattern)
  assert.truthy(tostring(e):find(pattern, 1, true), ("error %q does not contain %q"):format(tostring(e), pattern))
end

local function names(list)
  local out = {}
  for _, p in ipairs(list) do out[#out + 1] = p[1] end
  return table.concat(out, " ")
end

describe("nn.Module #unit", function()
  it("registers parameters, buffers and submodules by assignment and by name, in order", function()
    local Net = nn.Module:extend("Net")
    function Net:__init(h)
      self.conv1 = nn.Conv2d(1, 2, 3)
      self.fc = nn.Linear(8, h)
      self.scale = nn.Parameter(tensor.ones(1))
      self:register_buffer("steps", tensor.zeros(1))
      self:register_buffer("tmp", tensor.zeros(1), {persistent = false})
      self.plain = 5
    end
    function Net:forward(x) return self.fc(x) * self.scale end
    local m = Net(4)
    -- PyTorch's order: a module's own parameters, then its children's
    assert.are.equal("scale conv1.weight conv1.bias fc.weight fc.bias", names(m:named_parameters()))
    assert.are.equal(5, #m:parameters())
    assert.are.equal(2, #m:children())
    assert.are.equal(3, #m:modules())
    assert.are.equal(5, m.plain)
    local sd = m:state_dict()
    for _, k in ipairs{"conv1.weight", "conv1.bias", "fc.weight", "fc.bias", "scale", "steps"} do
      assert.is_true(tensor.is_tensor(sd[k]), k)
    end
    assert.is_nil(sd.tmp)
    -- assigning a tensor to a registered parameter name replaces it
    local w = tensor.zeros(4, 8, {requires_grad = true})
    m.fc.weight = w
    assert.is_true(rawequal(m.fc.weight, w))
    assert.is_true(rawequal(m.fc:parameters()[1], w))
    -- subclasses of subclasses, and the old init name
    local Big = Net:extend("Big")
    function Big:__init() Net.__init(self, 2); self.extra = nn.ReLU() end
    assert.are.equal(3, #Big():children())
    local Old = nn.Module:extend("Old")
    function Old:init(n) self.l = nn.Linear(n, n) end
    assert.are.equal(2, #Old(3):parameters())
  end)

  it("shares a parameter once, and train()/eval() reach every submodule", function()
    local a = nn.Linear(2, 2)
    local s = nn.Sequential(a, nn.Dropout(0.5), a)
    assert.are.equal(2, #s:parameters())
    s:eval()
    assert.is_false(s:children()[2].training)
    local x = tensor.ones(3, 2)
    assert.is_true(s(x):equal(a(a(x))))
    s:train()
    assert.is_true(s:children()[2].training)
  end)

  it("prints like PyTorch", function()
    local m = nn.Sequential(nn.Conv2d(1, 32, 3, {stride = 2, padding = 1, bias = false}), nn.BatchNorm2d(32),
      nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128, 10), nn.LSTM(10, 16, {num_layers = 2, batch_first = true}))
    local want = [[Sequential(
  (0): Conv2d(1, 32, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), bias=False)
  (1): BatchNorm2d(32, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
  (2): ReLU()
  (3): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
  (4): Flatten(start_dim=2, end_dim=-1)
  (5): Linear(in_features=128, out_features=10, bias=True)
  (6): LSTM(10, 16, num_layers=2, batch_first=True)
)]]
    assert.are.equal(want, tostring(m))
  end)

  it("load_state_dict lists missing and unexpected keys, and shape mismatches", function()
    local m = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    local sd = m:state_dict()
    sd["0.bias"] = nil
    sd["2.weight"] = tensor.zeros(1)
    raises("Missing key(s) in state_dict: 0.bias. Unexpected key(s) in state_dict: 2.weight", function()
      m:load_state_dict(sd)
    end)
    local r = m:load_state_dict(sd, {strict = false})
    assert.are.same({"0.bias"}, r.missing_keys)
    assert.are.same({"2.weight"}, r.unexpected_keys)
    raises("size mismatch for 0.weight: copying a param with shape Size([2, 2]), the shape in the current model " ..
      "is Size([3, 2])", function() m:load_state_dict({["0.weight"] = tensor.zeros(2, 2)}, {strict = false}) end)
    -- loading copies in place: the parameters keep their identity
    local w = m:children()[1].weight
    m:load_state_dict(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)):state_dict())
    assert.is_true(rawequal(w, m:children()[1].weight))
  end)

  it("saves state_dicts as .npz archives that round-trip (and that numpy reads)", function()
    local m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.LSTM(4, 5))
    local path = S.tmpdir .. "/model.npz"
    nn.save(m:state_dict(), path)
    local back = nn.load(path)
    local n = 0
    for k, v in pairs(m:state_dict()) do
      n = n + 1
      assert.is_true(back[k] ~= nil and back[k]:equal(v), k)
      assert.are.equal(v.dtype, back[k].dtype)
    end
    assert.are.equal(11, n)
    local m2 = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.LSTM(4, 5))
    m2:load_state_dict(back)
    assert.is_true(m2:children()[1].weight:equal(m:children()[1].weight))
    nn.save(m:state_dict(), path .. "c", {compressed = true})
    assert.is_true(nn.load(path .. "c")["2.weight_hh_l0"]:equal(m:children()[3].weight_hh_l0))
    if numpy_ok() then
      local p = io.popen(PY .. " -c \"import numpy as np; d = np.load('" .. path .. "'); " ..
        "print(' '.join(d.files), d['0.weight'].shape, d['1.num_batches_tracked'].dtype, " ..
        "round(float(d['2.bias_ih_l0'].sum()), 3))\"")
      local out = p:read("*a")
      p:close()
      local want = ("0.weight 0.bias 1.weight 1.bias 1.running_mean 1.running_var 1.num_batches_tracked " ..
        "2.weight_ih_l0 2.weight_hh_l0 2.bias_ih_l0 2.bias_hh_l0 (3, 2, 3, 3) int64 %.3f"):format(
        m:children()[3].bias_ih_l0:sum():item())
      assert.are.equal(want, (out:gsub("\n$", ""):gsub("%-0%.000", "0.000")))
    end
    raises("is not a readable .npz archive", function()
      local f = io.open(path .. "x", "wb"); f:write("PK\3\4 not really"); f:close()
      nn.load(path .. "x")
    end)
  end)

  it("zero_grad sets to nil by default and to zeros with set_to_none = false", function()
    local m = nn.Linear(2, 1)
    m(tensor.ones(1, 2)):sum():backward()
    m:zero_grad{set_to_none = false}
    assert.are.equal(0, m.weight.grad:abs():sum():item())
    m:zero_grad()
    assert.is_nil(m.weight.grad)
  end)

  it("to(dtype) and to('cpu') move parameters and buffers; deepcopy is independent", function()
    local m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    local w = m:children()[1].weight
    m:to("cpu")
    assert.is_true(rawequal(w, m:children()[1].weight))
    m:double()
    assert.are.equal(tensor.float64, m:children()[1].weight.dtype)
    assert.are.equal(tensor.float64, m:children()[2].running_mean.dtype)
    assert.are.equal(tensor.int64, m:children()[2].num_batches_tracked.dtype)
    assert.is_true(m:children()[1].weight.requires_grad)
    local c = nn.deepcopy(m)
    tensor.no_grad(function() c:children()[1].weight:fill_(0) end)
    assert.is_true(m:children()[1].weight:abs():sum():item() > 0)
  end)

  it("ModuleList and ModuleDict register their modules", function()
    local l = nn.ModuleList({nn.Linear(2, 2), nn.Linear(2, 3)})
    l:append(nn.ReLU())
    assert.are.equal(3, l:len())
    assert.are.equal(3, l[2].out_features)
    assert.are.equal("0.weight 0.bias 1.weight 1.bias", names(l:named_parameters()))
    local d = nn.ModuleDict({b = nn.Linear(1, 1), a = nn.Tanh()})
    assert.are.same({"a", "b"}, d:keys())
    assert.are.equal("b.weight b.bias", names(d:named_parameters()))
  end)
end)

describe("nn bad input #unit", function()
  it("names the layer, the expected shape and the one given", function()
    raises("Conv2d(1, 32, 3): expected input [N, 1, H, W], got [64, 64]", function()
      nn.Conv2d(1, 32, 3)(tensor.zeros(64, 64))
    end)
    raises("Linear(10, 5): expected input [*, 10], got [3, 4]", function() nn.Linear(10, 5)(tensor.zeros(3, 4)) end)
    raises("BatchNorm2d(8): expected input [N, 8, H, W], got [2, 4, 5, 5]", function()
      nn.BatchNorm2d(8)(tensor.zeros(2, 4, 5, 5))
    end)
    raises("LSTM(10, 16): expected input [L, N, 10], got [5, 3, 7]", function() nn.LSTM(10, 16)(tensor.zeros(5, 3, 7)) end)
    raises("LSTM(4, 3): expected hidden[0] size [1, 2, 3], got [1, 5, 3]", function()
      nn.LSTM(4, 3)(tensor.zeros(6, 2, 4), {tensor.zeros(1, 5, 3), tensor.zeros(1, 5, 3)})
    end)
    raises("MaxPool2d(2): expected input [N, C, H, W], got [5]", function() nn.MaxPool2d(2)(tensor.zeros(5)) end)
    raises("embedding: index out of range: indices must be in 1..4 (Lua indices), got 0..2", function()
      nn.Embedding(4, 2)(tensor.tensor({0LL, 2LL}))
    end)
    raises("CrossEntropyLoss: target must be a tensor, got string", function()
      nn.CrossEntropyLoss()(tensor.zeros(2, 3), "x")
    end)
    raises("cross_entropy: target must be an int64 tensor of 1-based class indices", function()
      nn.functional.cross_entropy(tensor.zeros(2, 3), {1, 2})
    end)
    raises("nll_loss: target 4 is out of bounds: target classes must be in 1..3", function()
      nn.CrossEntropyLoss()(tensor.zeros(2, 3), tensor.tensor({1LL, 4LL}))
    end)
    raises("conv2d: the kernel (5 x 5, dilated) is larger than the padded input (3 x 3)", function()
      nn.Conv2d(1, 1, 5)(tensor.zeros(1, 1, 3, 3))
    end)
    raises("mse_loss: target size [3, 1] must be the same as input size [3]", function()
      nn.MSELoss()(tensor.zeros(3), tensor.zeros(3, 1))
    end)
    raises("l1_loss: target size [2, 4] must be the same as input size [2, 3]", function()
      nn.L1Loss()(tensor.zeros(2, 3), tensor.zeros(2, 4))
    end)
    assert.are.equal(0, nn.MSELoss()(tensor.tensor(2.0), tensor.tensor(2.0)):item()) -- (0-dim: the same shape)
    raises("dropout probability has to be between 0 and 1, but got 1.5", function() nn.Dropout(1.5) end)
    raises("Embedding: the option max_norm is not supported", function() nn.Embedding(4, 2, {max_norm = 1}) end)
    raises("LSTM: the option proj_size is not supported", function() nn.LSTM(4, 2, {proj_size = 1}) end)
    raises("SGD: lr is required", function() optim.SGD(nn.Linear(1, 1):parameters()) end)
    raises("DataLoader: batch_size should be a positive integer value", function()
      tensor.data.DataLoader(tensor.data.TensorDataset(tensor.zeros(3)), {batch_size = 0})
    end)
  end)
end)

describe("nn default initialisation #unit", function()
  it("is PyTorch's per layer", function()
    tensor.manual_seed(3)
    local l = nn.Linear(400, 300)
    local b = 1 / math.sqrt(400)
    assert.is_true(l.weight:abs():max():item() <= b and l.weight:abs():max():item() > 0.95 * b)
    assert.is_true(l.bias:abs():max():item() <= b)
    local c = nn.Conv2d(16, 8, 3)
    local cb = 1 / math.sqrt(16 * 9)
    assert.is_true(c.weight:abs():max():item() <= cb and c.weight:abs():max():item() > 0.95 * cb)
    local e = nn.Embedding(1000, 50)
    assert.is_true(math.abs(e.weight:std():item() - 1) < 0.05)
    local r = nn.LSTM(10, 25)
    assert.is_true(r.weight_hh_l0:abs():max():item() <= 0.2)
    local bn = nn.BatchNorm2d(4)
    assert.is_true(bn.weight:equal(tensor.ones(4)) and bn.bias:equal(tensor.zeros(4)))
    local w = tensor.empty(200, 300)
    nn.init.xavier_uniform_(w)
    assert.is_true(w:abs():max():item() <= math.sqrt(6 / 500))
    nn.init.kaiming_normal_(w, {mode = "fan_out", nonlinearity = "relu"})
    assert.is_true(math.abs(w:std():item() - math.sqrt(2 / 200)) < 0.005)
    local q = tensor.empty(6, 4)
    nn.init.orthogonal_(q)
    assert.is_true((q:t():matmul(q) - tensor.eye(4)):abs():max():item() < 1e-5)
    nn.init.constant_(q, 0.5)
    assert.are.equal(12, q:sum():item())
  end)
end)

-- Compares analytic gradients of sum(f() * w) with central differences (float64)
-- for every tensor in `wrt` (inputs or parameters), at most 40 elements each.
local function gradcheck(name, f, wrt, tol)
  tol = tol or 1e-6
  local out = f()
  tensor.manual_seed(7)
  local w = tensor.rand(out:size(), f64) + 0.5
  for _, x in ipairs(wrt) do x.grad = nil end
  ;(f() * w):sum():backward()
  local h = 1e-6
  for wi, x in ipairs(wrt) do
    local flat = x:detach():view(-1)
    local g = x.grad:reshape(-1)
    local n = x:numel()
    local step = math.max(1, math.floor(n / 40))
    for k = 1, n, step do
      local orig = flat[k]:item()
      local function at(v)
        tensor.no_grad(function() flat[k] = v end)
        return tensor.no_grad(function() return (f() * w):sum():item() end)
      end
      local num = (at(orig + h) - at(orig - h)) / (2 * h)
      at(orig)
      local ana = g[k]:item()
      assert.is_true(math.abs(num - ana) <= tol * math.max(1, math.abs(num)),
        ("%s: d/d(arg %d)[%d]: analytic %.9g, numeric %.9g"):format(name, wi, k, ana, num))
    end
  end
end

local function params_and(m, ...)
  local list = m:parameters()
  for _, x in ipairs{...} do list[#list + 1] = x end
  return list
end

describe("nn gradients against finite differences (float64) #unit", function()
  local function x64(...) return tensor.randn(..., {dtype = tensor.float64, requires_grad = true}) end
  it("convolution", function()
    tensor.manual_seed(1)
    local c = nn.Conv2d(4, 6, 3, {stride = 2, padding = 1, dilation = 1, groups = 2, dtype = tensor.float64})
    local x = tensor.randn(2, 4, 6, 5, f64)
    x.requires_grad = true
    gradcheck("Conv2d", function() return c(x) end, params_and(c, x))
    local c2 = nn.Conv2d(2, 3, {2, 3}, {padding = {2, 1}, dilation = {2, 1}, dtype = tensor.float64})
    local x2 = tensor.randn(1, 2, 5, 6, f64)
    x2.requires_grad = true
    gradcheck("Conv2d dilated", function() return c2(x2) end, params_and(c2, x2))
    local c1 = nn.Conv1d(3, 2, 3, {stride = 2, dtype = tensor.float64})
    local x1 = tensor.randn(2, 3, 9, f64)
    x1.requires_grad = true
    gradcheck("Conv1d", function() return c1(x1) end, params_and(c1, x1))
  end)
  it("convolution over a batch that is split across threads and GEMM blocks", function()
    -- 7 samples of 3x3 outputs: parts of 4 and 3 samples, each one block
    tensor.manual_seed(11)
    local c = nn.Conv2d(4, 6, 3, {stride = 2, padding = 1, groups = 2, dtype = tensor.float64})
    local x = tensor.randn(7, 4, 5, 5, f64)
    x.requires_grad = true
    gradcheck("Conv2d batch of 7", function() return c(x) end, params_and(c, x))
  end)
  it("max pooling keeps PyTorch's argmax: the first of equal maxima, the first NaN", function()
    local F = nn.functional
    local opts = {kernel_size = 3, stride = 2, padding = 1, return_indices = true}
    local _, ties = F.max_pool2d(tensor.zeros(1, 1, 8, 8), opts)
    for oy = 1, 4 do
      for ox = 1, 4 do
        local want = math.max(0, (oy - 1) * 2 - 1) * 8 + math.max(0, (ox - 1) * 2 - 1) + 1
        assert.are.equal(want, ties[1][1][oy][ox]:item())
      end
    end
    -- PyTorch 1.13's answer for this input (its 0-based indices + 1)
    local x = tensor.arange(0, 64):view(1, 1, 8, 8):float()
    x[1][1][3][4], x[1][1][6][6] = 0 / 0, 0 / 0
    local y, idx = F.max_pool2d(x, opts)
    assert.are.same({{10, 12, 14, 16}, {26, 20, 20, 32}, {42, 44, 46, 46}, {58, 60, 46, 46}}, idx[1][1]:totable())
    assert.is_true(y[1][1][2][2]:item() ~= y[1][1][2][2]:item())
  end)
  it("pooling", function()
    tensor.manual_seed(2)
    local x = tensor.randn(2, 3, 7, 6, f64)
    x.requires_grad = true
    gradcheck("MaxPool2d", function() return nn.MaxPool2d(3, {stride = 2, padding = 1, ceil_mode = true})(x) end, {x})
    gradcheck("AvgPool2d", function() return nn.AvgPool2d(3, {stride = 2, padding = 1, count_include_pad = false})(x) end, {x})
    gradcheck("AdaptiveAvgPool2d", function() return nn.AdaptiveAvgPool2d({4, 4})(x) end, {x})
  end)
  it("normalisation", function()
    tensor.manual_seed(3)
    local x = tensor.randn(4, 6, 3, 3, f64)
    x.requires_grad = true
    local bn = nn.BatchNorm2d(6, {dtype = tensor.float64})
    gradcheck("BatchNorm2d", function() return bn(x) end, params_and(bn, x), 1e-5)
    local ln = nn.LayerNorm({3, 3}, {dtype = tensor.float64})
    gradcheck("LayerNorm", function() return ln(x) end, params_and(ln, x), 1e-5)
    local bare = nn.LayerNorm(4, {elementwise_affine = false, dtype = tensor.float64})
    gradcheck("LayerNorm without affine, strided input", function() return bare(x:transpose(1, 4)) end, {x}, 1e-5)
    local gn = nn.GroupNorm(3, 6, {dtype = tensor.float64})
    gradcheck("GroupNorm", function() return gn(x) end, params_and(gn, x), 1e-5)
  end)
  it("recurrent layers", function()
    tensor.manual_seed(4)
    local x = tensor.randn(4, 2, 3, f64)
    x.requires_grad = true
    for _, m in ipairs{nn.LSTM(3, 4, {num_layers = 2, dtype = tensor.float64}),
                       nn.GRU(3, 4, {bidirectional = true, dtype = tensor.float64}),
                       nn.RNN(3, 4, {dtype = tensor.float64})} do
      gradcheck(m.name, function() return (m(x)) end, params_and(m, x))
    end
    -- the whole-layer LSTM node: both directions, a given state, the final
    -- state's gradients flowing back too, and one step (the cell)
    local h0, c0 = tensor.randn(2, 2, 4, f64), tensor.randn(2, 2, 4, f64)
    h0.requires_grad, c0.requires_grad = true, true
    local bi = nn.LSTM(3, 4, {bidirectional = true, dtype = tensor.float64})
    gradcheck("bidirectional LSTM with a state", function()
      local y, hc = bi(x, {h0, c0})
      return tensor.cat({y:reshape(-1), hc[1]:reshape(-1), hc[2]:reshape(-1)})
    end, params_and(bi, x, h0, c0))
    local cell = nn.LSTMCell(3, 4, {dtype = tensor.float64})
    local x1, ch, cc = x:select(1, 1), h0:select(1, 1), c0:select(1, 1)
    gradcheck("LSTMCell", function()
      local hc = cell(x1, {ch, cc})
      return tensor.cat({hc[1]:reshape(-1), hc[2]:reshape(-1)})
    end, params_and(cell, x, h0, c0))
  end)
  it("cells take one unbatched step as PyTorch's do ([in] and [H] in, [H] out)", function()
    tensor.manual_seed(6)
    for _, name in ipairs({"RNNCell", "LSTMCell", "GRUCell"}) do
      local c = nn[name](4, 3, {dtype = tensor.float64})
      local x = tensor.randn(4, f64)
      local lstm = name == "LSTMCell"
      local h = lstm and {tensor.randn(3, f64), tensor.randn(3, f64)} or tensor.randn(3, f64)
      local got = c(x, h)
      local want = c(x:unsqueeze(1), lstm and {h[1]:unsqueeze(1), h[2]:unsqueeze(1)} or h:unsqueeze(1))
      if lstm then
        assert.is_true(got[1]:dim() == 1 and got[1]:size(1) == 3 and got[2]:dim() == 1)
        assert.is_true(got[1]:equal(want[1]:squeeze(1)) and got[2]:equal(want[2]:squeeze(1)), name)
      else
        assert.is_true(got:dim() == 1 and got:size(1) == 3)
        assert.is_true(got:equal(want:squeeze(1)), name)
      end
      local ok, e = pcall(c, x, lstm and {tensor.zeros(1, 3, f64), tensor.zeros(3, f64)} or tensor.zeros(2, 3, f64))
      assert.is_false(ok)
      assert.truthy(tostring(e):find("an unbatched input [4] takes an unbatched", 1, true), tostring(e))
      ok, e = pcall(c, tensor.zeros(5, f64))
      assert.truthy(not ok and tostring(e):find("expected input [N, 4] or [4], got [5]", 1, true), tostring(e))
    end
  end)
  it("attention, embeddings and activations", function()
    tensor.manual_seed(5)
    local q = tensor.randn(3, 2, 8, f64)
    q.requires_grad = true
    local lin, nob = nn.Linear(5, 3, {dtype = tensor.float64}), nn.Linear(5, 3, {bias = false, dtype = tensor.float64})
    local xl = tensor.randn(5, 4, f64)
    xl.requires_grad = true
    -- the input a transposed view, which the kernel reads in place
    gradcheck("Linear", function() return lin(xl:t()) end, params_and(lin, xl))
    gradcheck("Linear without bias", function() return nob(xl:t()) end, params_and(nob, xl))
    local mha = nn.MultiheadAttention(8, 2, {dtype = tensor.float64})
    gradcheck("MultiheadAttention", function() return (mha(q, q, q)) end, params_and(mha, q))
    local eb = nn.EmbeddingBag(6, 3, {mode = "mean", dtype = tensor.float64})
    local idx = tensor.tensor({{1LL, 2LL, 2LL}, {6LL, 5LL, 1LL}})
    gradcheck("EmbeddingBag", function() return eb(idx) end, eb:parameters())
    local x = tensor.randn(3, 5, f64)
    x.requires_grad = true
    for _, m in ipairs{nn.GELU(), nn.GELU{approximate = "tanh"}, nn.ELU(), nn.SiLU(), nn.LeakyReLU(0.1),
                       nn.Softplus(), nn.LogSoftmax{dim = 2}, nn.Softmax{dim = 2}, nn.Softmax{dim = 1}} do
      gradcheck(m.name, function() return m(x) end, {x}, 1e-5)
    end
    -- the C kernel (last dimension) against the tensor method, on a strided input with masked entries
    local s = tensor.randn(4, 6, 7):transpose(2, 3):masked_fill(tensor.rand(4, 7, 6):lt(0.3), -math.huge)
    for _, fn in ipairs{"softmax", "log_softmax"} do
      local got, want = nn.functional[fn](s, 3), s[fn](s, 3)
      local masked = want:eq(-math.huge)
      assert.is_true(got:eq(-math.huge):eq(masked):all():item(), fn .. ": the same entries are -inf")
      local err = (got:masked_fill(masked, 0) - want:masked_fill(masked, 0)):abs():max():item()
      assert.is_true(err <= 1e-5, fn .. ": max difference " .. err)
    end
  end)
  it("losses", function()
    tensor.manual_seed(6)
    local x = tensor.randn(4, 3, f64)
    x.requires_grad = true
    local t = tensor.tensor({1LL, 3LL, 2LL, 3LL})
    local w = tensor.tensor({0.5, 1, 2}, f64)
    gradcheck("CrossEntropyLoss", function()
      return nn.CrossEntropyLoss{weight = w, label_smoothing = 0.2}(x, t)
    end, {x})
    local y = tensor.rand(4, 3, f64)
    gradcheck("BCEWithLogitsLoss", function() return nn.BCEWithLogitsLoss()(x, y) end, {x})
    gradcheck("SmoothL1Loss", function() return nn.SmoothL1Loss{beta = 0.5}(x, y) end, {x})
    gradcheck("KLDivLoss", function() return nn.KLDivLoss{reduction = "batchmean"}(x:log_softmax(2), y) end, {x})
  end)
end)

-- The C kernels split a batch over the thread pool and run several samples'
-- columns through one GEMM (host/tensor/nn/nn_conv.c); a batch of one takes
-- neither path, so each sample alone is the reference for the batch.
describe("nn kernels over a batch equal them sample by sample #unit", function()
  local function close(what, got, want)
    local err = (got - want):abs():max():item()
    local scale = math.max(1, want:abs():max():item())
    assert.is_true(err <= 1e-5 * scale, ("%s: max difference %g"):format(what, err))
  end
  local function per_sample(m, x)
    local ys, gxs = {}, {}
    local gw, gb
    for i = 1, x:size(1) do
      m:zero_grad()
      local xi = x:narrow(1, i, 1):detach()
      xi.requires_grad = true
      local y = m(xi)
      y:sum():backward()
      ys[i], gxs[i] = y:detach(), xi.grad
      gw = gw and gw + m.weight.grad or m.weight.grad:clone()
      if m.bias ~= nil then gb = gb and gb + m.bias.grad or m.bias.grad:clone() end
    end
    return tensor.cat(ys, 1), tensor.cat(gxs, 1), gw, gb
  end
  for _, case in ipairs{
    {"3x3 padded, maps of 36", function() return nn.Conv2d(8, 5, 3, {padding = 1}) end, {9, 8, 6, 6}},
    {"grouped, strided", function() return nn.Conv2d(6, 4, 3, {stride = 2, groups = 2}) end, {5, 6, 9, 9}},
    {"1x1 (the input is its own columns)", function() return nn.Conv2d(8, 6, 1, {bias = false}) end, {6, 8, 3, 3}},
    {"1x1 stride 2", function() return nn.Conv2d(4, 6, 1, {stride = 2}) end, {3, 4, 7, 7}},
    {"wide maps, one sample per GEMM", function() return nn.Conv2d(3, 4, 3, {padding = 2, dilation = 2}) end,
     {4, 3, 40, 40}},
  } do
    it("Conv2d " .. case[1], function()
      tensor.manual_seed(12)
      local m = case[2]()
      local x = tensor.randn(case[3])
      x.requires_grad = true
      m:zero_grad()
      local y = m(x)
      y:sum():backward()
      local gw, gb = m.weight.grad, m.bias ~= nil and m.bias.grad or nil
      local ry, rgx, rgw, rgb = per_sample(m, x:detach())
      close("output", y:detach(), ry)
      close("input gradient", x.grad, rgx)
      close("weight gradient", gw, rgw)
      if rgb then close("bias gradient", gb, rgb) end
    end)
  end
  -- a 9x9 kernel that is zero outside its middle 3x3 is that 3x3 kernel with
  -- 3 less padding (the padded copy's border, read by 81 taps)
  it("Conv2d of 81 taps equals the 3x3 kernel inside it", function()
    tensor.manual_seed(13)
    local w3 = tensor.randn(4, 3, 3, 3)
    local w9 = tensor.zeros(4, 3, 9, 9)
    w9:narrow(3, 4, 3):narrow(4, 4, 3):copy_(w3)
    local x = tensor.randn(5, 3, 7, 6)
    local function run(w, pad)
      local xi = x:clone()
      xi.requires_grad = true
      local y = nn.functional.conv2d(xi, w, {padding = pad, stride = 2})
      local loss = (y * y):sum()
      loss:backward()
      return y:detach(), xi.grad
    end
    local y9, g9 = run(w9, 4)
    local y3, g3 = run(w3, 1)
    close("output", y9, y3)
    close("input gradient", g9, g3)
  end)
end)

-- The column matrix (host/tensor/nn/nn_conv.c) is gathered through an offset
-- table for narrow outputs (under 16 wide: AVX-512 gathers for float32) and
-- copied row by row for wide ones (vectors for stride 1, a loop of its own for
-- stride 2); col2im adds back the same two ways. Here each geometry is checked
-- against convolution done tap by tap with tensor ops (a strided slice of the
-- zero-padded input times the tap's [O, C] weights), and the gradients by the
-- adjoint identities <y, gy> = <x, gx> = <w, gw> (a convolution is linear in
-- each).
describe("convolution's column paths against a tap-by-tap reference #unit", function()
  local F = nn.functional
  local function reference(x, w, stride, pad, dil)
    local n, c, h, wd = x:size(1), x:size(2), x:size(3), x:size(4)
    local o, kh, kw = w:size(1), w:size(3), w:size(4)
    local xp = tensor.zeros({n, c, h + 2 * pad, wd + 2 * pad}, {dtype = x.dtype})
    xp:narrow(3, pad + 1, h):narrow(4, pad + 1, wd):copy_(x)
    local oh = math.floor((h + 2 * pad - dil * (kh - 1) - 1) / stride) + 1
    local ow = math.floor((wd + 2 * pad - dil * (kw - 1) - 1) / stride) + 1
    local function at(start, count)
      local idx = {}
      for i = 1, count do idx[i] = start + (i - 1) * stride - 1 end
      return tensor.tensor(idx, {dtype = tensor.int64}) + 1
    end
    local y = tensor.zeros({n, oh, ow, o}, {dtype = x.dtype})
    for ki = 0, kh - 1 do
      for kj = 0, kw - 1 do
        local patch = xp:index_select(3, at(ki * dil + 1, oh)):index_select(4, at(kj * dil + 1, ow))
        y = y + patch:permute(1, 3, 4, 2):contiguous():matmul(w:select(3, ki + 1):select(3, kj + 1):t())
      end
    end
    return y:permute(1, 4, 2, 3):contiguous()
  end
  local function dot(a, b) return (a:double() * b:double()):sum():item() end
  for _, case in ipairs{
    -- n, c, h, w, o, k, stride, padding, dilation
    {"wide rows with a tail (37), padded", {3, 3, 11, 37, 4, 3, 1, 1, 1}},
    {"wide rows, stride 2 (the stem's 7x7)", {2, 3, 40, 38, 5, 7, 2, 3, 1}},
    {"wide rows, dilation 2", {2, 4, 19, 40, 3, 3, 1, 2, 2}},
    -- float32 with AVX-512: im2col copies rows of 4..15 at stride 1 as masked
    -- vectors (else gathers); col2im sums planes whose padded rows are <= 16 wide
    -- (and stride 1 along them) a row per register (else scatters)
    {"narrow rows of 4, padded", {5, 6, 4, 4, 7, 3, 1, 1, 1}},
    {"narrow rows of 15", {2, 3, 6, 15, 4, 3, 1, 1, 1}},
    {"8x8 maps (ResNet's second stage), padded", {4, 5, 8, 8, 6, 3, 1, 1, 1}},
    {"narrow rows of 9, dilation 2", {2, 3, 9, 9, 4, 3, 1, 2, 2}},
    {"narrow rows of 3 (gathered, a padded row of 5)", {3, 4, 3, 3, 5, 3, 1, 1, 1}},
    {"narrow rows, stride 2 (gathered and scattered)", {3, 4, 9, 9, 5, 3, 2, 1, 1}},
    {"1x1 stride 2 (gathered)", {4, 8, 9, 9, 6, 1, 2, 0, 1}},
    {"1x1 stride 1 (the input is its own columns), 4x4 maps", {5, 8, 4, 4, 6, 1, 1, 0, 1}},
    {"2x2 maps (ResNet's last stage)", {8, 16, 2, 2, 8, 3, 1, 1, 1}},
  } do
    for _, dt in ipairs{tensor.float32, tensor.float64} do
      it(case[1] .. ", " .. (dt == tensor.float32 and "float32" or "float64"), function()
        local n, c, h, wd, o, k, stride, pad, dil = table.unpack(case[2])
        tensor.manual_seed(21)
        local x = tensor.randn({n, c, h, wd}, {dtype = dt, requires_grad = true})
        local w = tensor.randn({o, c, k, k}, {dtype = dt, requires_grad = true})
        local y = F.conv2d(x, w, {stride = stride, padding = pad, dilation = dil})
        local want = reference(x:detach(), w:detach(), stride, pad, dil)
        local tol = dt == tensor.float32 and 1e-4 or 1e-10
        local err = (y:detach() - want):abs():max():item()
        assert.is_true(err <= tol * math.max(1, want:abs():max():item()), "output differs by " .. err)
        local gy = tensor.randn(y:size(), {dtype = dt})
        y:backward(gy)
        local yg = dot(y:detach(), gy)
        for what, pair in pairs{input = {x:detach(), x.grad}, weight = {w:detach(), w.grad}} do
          local got = dot(pair[1], pair[2])
          assert.is_true(math.abs(got - yg) <= tol * 10 * math.max(1, math.abs(yg)),
            ("<%s, its gradient> = %g, <y, gy> = %g"):format(what, got, yg))
        end
      end)
    end
  end
end)

-- Batch norm's float32 statistics are summed in float32 vector lanes folded
-- into double every 256 terms (host/tensor/nn/nn_norm.c), short maps a whole row
-- of channels at a time: they must stay as close to the float64 answer as
-- double sums were, for long and short maps, many channels of short maps
-- (several row chunks), large batches (several folds) and a mean far from 0.
describe("batch norm in float32 against float64 #unit", function()
  local F = nn.functional
  local function run(x, w, b, g)
    local rm, rv = tensor.zeros({x:size(2)}, {dtype = x.dtype}), tensor.ones({x:size(2)}, {dtype = x.dtype})
    x = x:detach()
    x.requires_grad, w.requires_grad, b.requires_grad = true, true, true
    local y = F.batch_norm(x, rm, rv, {weight = w, bias = b, training = true})
    y:backward(g)
    return {y = y:detach(), gx = x.grad, gw = w.grad, gb = b.grad, rm = rm, rv = rv}
  end
  for _, case in ipairs{
    {"maps of 33x31, mean 100", {4, 5, 33, 31}, 100},
    {"4x4 maps", {8, 16, 4, 4}, 0},
    {"2x2 maps over 300 channels (three row chunks)", {8, 300, 2, 2}, 3},
    {"a batch of 600 of 1x3 maps (folds across rows)", {600, 7, 1, 3}, 0},
    {"BatchNorm1d over 64 x 20, mean 5", {64, 20}, 5},
  } do
    it(case[1], function()
      tensor.manual_seed(31)
      -- the same values both ways (float32's)
      local x = (tensor.randn(case[2], f64) * 2 + case[3]):float():double()
      local c = case[2][2]
      local w, b = tensor.randn({c}):double(), tensor.randn({c}):double()
      local g = tensor.randn(case[2]):double()
      local want = run(x, w:clone(), b:clone(), g)
      local got = run(x:float(), w:float(), b:float(), g:float())
      for _, k in ipairs{"y", "gx", "gw", "gb", "rm", "rv"} do
        local err = (got[k]:double() - want[k]):abs():max():item()
        local scale = want[k]:abs():max():item()
        assert.is_true(err <= 2e-6 * math.max(scale, 1), ("%s differs by %g (of %g)"):format(k, err, scale))
      end
    end)
  end
end)

-- ReLU's backward is one C pass (host/tensor/nn/nn_act.c) for contiguous host
-- floats and the composition g * (a > 0) otherwise; both must agree, and
-- where a <= 0 the gradient is 0 even when g is not finite (PyTorch's
-- threshold_backward), where g * 0 made NaN of an infinite or NaN gradient.
describe("ReLU backward #unit", function()
  for _, dt in ipairs{tensor.float32, tensor.float64} do
    it("equals g * (a > 0) for contiguous and strided gradients, " .. tostring(dt), function()
      tensor.manual_seed(21)
      local a = tensor.randn(6, 7, {dtype = dt})
      a.requires_grad = true
      local g = tensor.randn(7, 6, {dtype = dt})
      for _, gi in ipairs{g:t():contiguous(), g:t()} do
        a.grad = nil
        a:relu():backward(gi)
        local want = gi * (a:detach():gt(0)):to(dt)
        assert.are.equal(0, (a.grad - want):abs():max():item())
      end
    end)
  end
  it("gives 0 where the input is not positive, whatever the gradient", function()
    local a = tensor.tensor({-1, 0, 2, 3})
    a.requires_grad = true
    a:relu():backward(tensor.tensor({0 / 0, math.huge, 0 / 0, 5}))
    local got = a.grad
    assert.are.equal(0, got[1]:item())
    assert.are.equal(0, got[2]:item())
    assert.is_true(got[3]:item() ~= got[3]:item())
    assert.are.equal(5, got[4]:item())
  end)
end)

describe("matrix products split over the thread pool #unit", function()
  -- products of 2^23 multiply-adds or more are cut into row or column blocks;
  -- ten rows at a time stay whole, so they are the reference
  for _, sz in ipairs{{320, 150, 200, "rows"}, {20, 640, 800, "columns"}} do
    local m, k, n = sz[1], sz[2], sz[3]
    it(("[%d x %d] @ [%d x %d] of transposed views, split by %s"):format(m, k, k, n, sz[4]), function()
      tensor.manual_seed(14)
      local a = tensor.randn(k, m, f64):t()
      local b = tensor.randn(n, k, f64):t()
      local want = {}
      for i = 1, m, 10 do want[#want + 1] = a:narrow(1, i, math.min(10, m - i + 1)):matmul(b) end
      local err = (a:matmul(b) - tensor.cat(want, 1)):abs():max():item()
      assert.is_true(err <= 1e-10, "max difference " .. err)
    end)
  end
  it("reads a slice of wider rows, and its transpose, in place", function()
    tensor.manual_seed(15)
    local a = tensor.randn(33, 50, f64):narrow(2, 4, 40)  -- rows 50 apart
    local b = tensor.randn(27, 60, f64):narrow(2, 11, 40):t() -- [40, 27], transposed rows 60 apart
    local err = (a:matmul(b) - a:contiguous():matmul(b:contiguous())):abs():max():item()
    assert.is_true(err <= 1e-12, "max difference " .. err)
  end)
  -- small products go one per pool task, large ones are split
  for _, sz in ipairs{{12, 9, 7, 5}, {2, 256, 128, 256}} do
    local b, m, k, n = sz[1], sz[2], sz[3], sz[4]
    it(("bmm of %d [%d x %d] @ [%d x %d] transposed views equals the products one by one"):format(b, m, k, k, n),
      function()
        tensor.manual_seed(13)
        local a = tensor.randn(m, b, k):transpose(1, 2) -- [b, m, k], batch stride k
        local c = tensor.randn(b, n, k):transpose(2, 3) -- [b, k, n], each matrix transposed
        local y = a:bmm(c)
        local want = {}
        for i = 1, b do want[i] = a:select(1, i):contiguous():matmul(c:select(1, i):contiguous()):unsqueeze(1) end
        local err = (y - tensor.cat(want, 1)):abs():max():item()
        assert.is_true(err <= 1e-4, "max difference " .. err)
      end)
  end
end)

describe("nn in training #unit", function()
  it("dropout scales kept values in training and is the identity in eval", function()
    tensor.manual_seed(8)
    local d = nn.Dropout(0.25)
    local y = d(tensor.ones(10000))
    local kept = y:gt(0):sum():item()
    assert.is_true(kept > 7200 and kept < 7800, kept)
    assert.is_true(math.abs(y:max():item() - 1 / 0.75) < 1e-6)
    d:eval()
    assert.is_true(d(tensor.ones(5)):equal(tensor.ones(5)))
    local d2 = nn.Dropout2d(0.5)(tensor.ones(4, 8, 3, 3))
    -- whole channels: every channel is all zeros or all kept
    local per = d2:reshape(32, 9)
    assert.is_true((per:max(2) - per:min(2)):abs():max():item() == 0)
    -- p = 1 drops everything, channels too: zeros (as PyTorch), not 0 / 0
    local F = nn.functional
    for _, y in ipairs({F.dropout(tensor.ones(3, 4), 1), F.dropout2d(tensor.ones(2, 3, 2, 2), 1),
                        F.dropout1d(tensor.ones(2, 3, 4), 1)}) do
      assert.is_true(y:equal(tensor.zeros(unpack(y:size()))), tostring(y))
    end
  end)

  it("BatchNorm running statistics follow the momentum; eval uses them", function()
    local bn = nn.BatchNorm1d(2, {momentum = 0.5})
    local x = tensor.tensor({{1, 10}, {3, 30}})
    bn(x)
    assert.is_true(bn.running_mean:allclose(tensor.tensor({1, 10})))
    assert.is_true(bn.running_var:allclose(tensor.tensor({1.5, 100.5})))
    assert.are.equal(1, bn.num_batches_tracked:item())
    bn:eval()
    local y = bn(x)
    assert.is_true(y:allclose((x - bn.running_mean) / (bn.running_var + 1e-5):sqrt()))
  end)

  it("a conv net learns synthetic 8x8 digit-like images to a loss below 0.1", function()
    -- four classes of 8x8 images: a bar in one of four positions, plus noise
    tensor.manual_seed(42)
    local n = 256
    local imgs = tensor.randn(n, 1, 8, 8) * 0.3
    local labels = {}
    for i = 1, n do
      local c = (i - 1) % 4 + 1
      labels[i] = c
      local img = imgs[i][1]
      if c == 1 then img:narrow(1, 2, 2):add_(1)
      elseif c == 2 then img:narrow(1, 6, 2):add_(1)
      elseif c == 3 then img:narrow(2, 2, 2):add_(1)
      else img:narrow(2, 6, 2):add_(1) end
    end
    local y = tensor.tensor(labels, {dtype = tensor.int64})
    local Net = nn.Module:extend("DigitNet")
    function Net:__init()
      self.conv1 = nn.Conv2d(1, 8, 3, {padding = 1})
      self.bn1 = nn.BatchNorm2d(8)
      self.conv2 = nn.Conv2d(8, 16, 3, {padding = 1})
      self.pool = nn.MaxPool2d(2)
      self.drop = nn.Dropout(0.1)
      self.fc = nn.Linear(16 * 2 * 2, 4)
    end
    function Net:forward(x)
      x = self.pool(self.bn1(self.conv1(x)):relu())
      x = self.pool(self.conv2(x):relu())
      return self.fc(self.drop(x:flatten(2)))
    end
    local model = Net()
    local opt = optim.Adam(model, {lr = 0.01})
    local sched = optim.lr_scheduler.StepLR(opt, 10, {gamma = 0.5})
    local loader = tensor.data.DataLoader(tensor.data.TensorDataset(imgs, y), {batch_size = 32, shuffle = true, seed = 1})
    local crit = nn.CrossEntropyLoss()
    for _ = 1, 15 do
      for xb, yb in loader:iter() do
        opt:zero_grad()
        local loss = crit(model(xb), yb)
        loss:backward()
        nn.utils.clip_grad_norm_(model:parameters(), 5)
        opt:step()
      end
      sched:step()
    end
    model:eval()
    local final = tensor.no_grad(function() return crit(model(imgs), y):item() end)
    assert.is_true(final < 0.1, "final loss " .. final)
  end)
end)

describe("nn.utils.stateless.functional_call #unit", function()
  local fc = nn.utils.stateless.functional_call
  it("runs the module on the given tensors, restores its own, and differentiates through them", function()
    tensor.manual_seed(3)
    local m = nn.Sequential(nn.Linear(2, 3, f64), nn.Tanh(), nn.Linear(3, 1, f64))
    local x = tensor.randn(5, 2, f64)
    local w0 = m[1].weight
    local w2 = w0:detach() * 2
    local want = (x:matmul(w2:t()) + m[1].bias):tanh():matmul(m[3].weight:t()) + m[3].bias
    local y = fc(m, {["0.weight"] = w2}, x)
    assert.is_true(y:allclose(want, 1e-12, 1e-12))
    assert.are.equal(w0, m[1].weight)
    -- a clone of the parameters: the backward reaches them, and changing them in
    -- place after the forward (another trainer's step) is no error for this one
    local copies = {}
    for _, np in ipairs(m:named_parameters()) do copies[np[1]] = np[2]:clone() end
    local out = fc(m, copies, x):sum()
    local wbefore = m[1].weight:detach():clone()
    tensor.no_grad(function() m[1].weight:add_(1) end)
    out:backward()
    local ref = nn.Sequential(nn.Linear(2, 3, f64), nn.Tanh(), nn.Linear(3, 1, f64))
    ref:load_state_dict(m:state_dict())
    tensor.no_grad(function() ref[1].weight:copy_(wbefore) end)
    ref(x):sum():backward()
    assert.is_true(m[1].weight.grad:allclose(ref[1].weight.grad, 1e-12, 1e-12))
    assert.is_true(m[3].bias.grad:allclose(ref[3].bias.grad, 1e-12, 1e-12))
  end)

  it("names what is wrong, and restores the module when the forward raises", function()
    local m = nn.Linear(2, 3)
    local w = m.weight
    local ok, e = pcall(fc, m, {["fc.nope"] = tensor.zeros(1)}, tensor.zeros(1, 2))
    assert.is_false(ok)
    assert.truthy(tostring(e):find('no parameter or buffer named "fc.nope"', 1, true), tostring(e))
    ok = pcall(fc, m, {weight = tensor.zeros(3, 5)}, tensor.zeros(1, 2))
    assert.is_false(ok)
    assert.are.equal(w, m.weight)
  end)
end)

describe("optim and data behaviour #unit", function()
  it("an optimizer prints as PyTorch's: its groups' options, betas as a tuple, no initial_lr until a scheduler", function()
    local m = nn.Linear(3, 1)
    local o = optim.Adam(m:parameters(), {lr = 1e-3})
    local s = tostring(o)
    assert.truthy(s:find("Adam (\nParameter Group 0\n", 1, true), s)
    assert.truthy(s:find("    betas: (0.9, 0.999)\n", 1, true), s)
    assert.truthy(s:find("    lr: 0.001\n", 1, true), s)
    assert.falsy(s:find("initial_lr", 1, true), s)
    optim.lr_scheduler.StepLR(o, 1)
    assert.truthy(tostring(o):find("    initial_lr: 0.001\n", 1, true), tostring(o))
  end)

  it("optimizers take modules, param groups and closures; clip_grad_*", function()
    local m = nn.Linear(3, 1)
    local o = optim.SGD({{params = {m.weight}, lr = 0.1}, {params = {m.bias}, lr = 0}}, {lr = 1, momentum = 0.9})
    assert.are.equal(0.9, o.param_groups[2].momentum)
    local b0 = m.bias:clone()
    local loss = o:step(function()
      o:zero_grad()
      local l = m(tensor.ones(2, 3)):sum()
      l:backward()
      return l
    end)
    assert.is_true(tensor.is_tensor(loss))
    assert.is_true(m.bias:equal(b0))
    m.weight.grad = tensor.tensor({{3, 4, 0}})
    local total = nn.utils.clip_grad_norm_({m.weight}, 1)
    assert.is_true(math.abs(total:item() - 5) < 1e-6)
    assert.is_true(math.abs(m.weight.grad:norm():item() - 1) < 1e-5)
    nn.utils.clip_grad_value_({m.weight}, 0.1)
    assert.is_true(m.weight.grad:abs():max():item() <= 0.1 + 1e-7)
  end)

  it("DataLoader shuffles reproducibly with a seed, differently per epoch, and honours drop_last and samplers", function()
    local ds = tensor.data.TensorDataset(tensor.arange(1, 11))
    local function epoch(dl)
      local seen = {}
      for x in dl:iter() do for _, v in ipairs(x:totable()) do seen[#seen + 1] = v end end
      return seen
    end
    local a = tensor.data.DataLoader(ds, {batch_size = 3, shuffle = true, seed = 5})
    local b = tensor.data.DataLoader(ds, {batch_size = 3, shuffle = true, seed = 5})
    local e1 = epoch(a)
    assert.are.same(e1, epoch(b))
    assert.are_not.same(e1, epoch(a))
    local sorted = {unpack(e1)}
    table.sort(sorted)
    assert.are.same({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, sorted)
    local d = tensor.data.DataLoader(ds, {batch_size = 3, drop_last = true})
    assert.are.equal(3, d:len())
    assert.are.equal(9, #epoch(d))
    local s0 = tensor.data.DistributedSampler(ds, {num_replicas = 2, rank = 0, shuffle = false})
    local s1 = tensor.data.DistributedSampler(ds, {num_replicas = 2, rank = 1, shuffle = false})
    assert.are.same({1, 3, 5, 7, 9}, epoch(tensor.data.DataLoader(ds, {batch_size = 2, sampler = s0})))
    assert.are.same({2, 4, 6, 8, 10}, epoch(tensor.data.DataLoader(ds, {batch_size = 2, sampler = s1})))
  end)

  it("reads CSV (gzipped too), .npy and .npz into tensors", function()
    local path = S.tmpdir .. "/data.csv"
    local f = io.open(path, "w")
    f:write("x,y,label\n1.5,2,0\n-3,4e-1,1\n")
    f:close()
    local t, header = tensor.data.read_csv(path)
    assert.are.same({"x", "y", "label"}, header)
    assert.is_true(t:allclose(tensor.tensor({{1.5, 2, 0}, {-3, 0.4, 1}})))
    os.execute("gzip -kf " .. path)
    local tz = tensor.data.read_csv(path .. ".gz")
    assert.is_true(tz:equal(t))
    raises("line 1 field 2 (\"oops\") is not a number", function()
      local g = io.open(path, "w"); g:write("1,oops\n"); g:close()
      tensor.data.read_csv(path, {header = false, skip_rows = 0})
    end)
    tensor.save(t, S.tmpdir .. "/t.npy")
    assert.is_true(tensor.data.load(S.tmpdir .. "/t.npy"):equal(t))
    nn.save({a = t}, S.tmpdir .. "/t.npz")
    assert.is_true(tensor.data.load(S.tmpdir .. "/t.npz").a:equal(t))
  end)

  it("distributions sample in range and with the right frequencies", function()
    tensor.manual_seed(9)
    local c = tensor.distributions.Categorical(tensor.tensor({0.1, 0.6, 0.3}))
    local s = c:sample({4000})
    assert.are.equal(tensor.int64, s.dtype)
    assert.is_true(s:min():item() >= 1 and s:max():item() <= 3)
    local f2 = s:eq(2LL):sum():item() / 4000
    assert.is_true(math.abs(f2 - 0.6) < 0.04, f2)
    local logits = tensor.zeros(3, {requires_grad = true})
    local d = tensor.distributions.Categorical{logits = logits}
    d:log_prob(tensor.tensor({2LL})):sum():backward()
    assert.is_true(logits.grad:allclose(tensor.tensor({-1 / 3, 2 / 3, -1 / 3})))
    local nrm = tensor.distributions.Normal(tensor.tensor({1.0}), tensor.tensor({2.0}))
    local ns = nrm:sample({5000})
    assert.is_true(math.abs(ns:mean():item() - 1) < 0.1 and math.abs(ns:std():item() - 2) < 0.1)
  end)
end)

describe("nn over rpc #world", function()
  it("a module travels by name with its parameters and trains remotely", function()
    local r = S.world(2, S.prelude .. [[
      local tensor = require "tensor"
      local nn = require "nn"
      Net = nn.Module:extend("Net")
      function Net:__init() self.conv = nn.Conv2d(1, 2, 3); self.bn = nn.BatchNorm2d(2); self.fc = nn.Linear(8, 3) end
      function Net:forward(x) return self.fc(self.bn(self.conv(x)):relu():flatten(2)) end
      function apply(m, x) return m(x), m:state_dict()["bn.running_mean"], tostring(m) end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        tensor.manual_seed(1)
        local m = Net()
        local x = tensor.randn(2, 1, 4, 4)
        local y, rm, s = rpc.rpc_sync("worker1", apply, {m, x})
        local want = m(x)
        check("same output", y:allclose(want, 1e-5, 1e-6), tostring(y) .. " vs " .. tostring(want))
        check("buffers travel", rm:allclose(m.bn.running_mean, 1e-5, 1e-6))
        check("printed", s:find("(conv): Conv2d(1, 2, kernel_size=(3, 3), stride=(1, 1))", 1, true) ~= nil, s)
        local rr = rpc.remote("worker1", nn.Linear, {4, 2})
        local out = rr:rpc_sync():forward(tensor.ones(1, 4))
        check("remote nn.Linear", tostring(out:size()) == "Size([1, 2])", out)
      end
      rpc.shutdown()
    ]], {timeout = 60})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)
end)

describe("containers and optimizer closures #unit", function()
  it("index Sequential and ModuleList by position, and run a step's closure once", function()
    local s = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert.are.equal(s:get(1), s[1])
    assert.are.equal(s:get(3), s[3])
    assert.is_nil(s[4])
    local ml = nn.ModuleList({nn.Linear(1, 1), nn.Tanh()})
    assert.are.equal(ml:get(2), ml[2])
    local calls = 0
    local opt = optim.SGD(s:parameters(), {lr = 0.1})
    opt:step(function() calls = calls + 1 end) -- (returns nothing)
    assert.are.equal(1, calls)
  end)
end)
