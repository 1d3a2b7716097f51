-- nn against PyTorch: every layer, loss, optimizer step, scheduler and
-- distribution compared with the reference results that
-- bench/fixtures/make_nn_fixtures.py computed with PyTorch 1.13 and committed
-- under spec/fixtures/nn/ (.npz, read with nn.load). A layer's parameters are
-- loaded from PyTorch's state_dict with load_state_dict (strict), so the
-- parameter and buffer names are checked too; then outputs, input gradients and
-- parameter gradients for loss = sum(out * gy). PyTorch is not needed here.
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"

local DIR = "spec/fixtures/nn/"

local function fixture(name) return nn.load(DIR .. name .. ".npz") end

local function assert_close(what, got, want, tol)
  tol = tol or 1e-4
  assert.is_true(tensor.is_tensor(got), what .. ": not a tensor")
  assert.are.equal(tostring(want:size()), tostring(got:size()), what .. ": shape")
  if want:numel() == 0 then return end
  local g, w = got:detach():double(), want:double()
  local d = ((g - w):abs() / (w:abs() + 1)):max():item()
  assert.is_true(d <= tol, ("%s: relative difference %g > %g"):format(what, d, tol))
end

local function idx1(t) return t + 1LL end -- PyTorch's 0-based indices, Lua's 1-based

-- runs a layer case: make() builds the module; call(m, ins) runs it
local function layer_case(name, make, call, o)
  o = o or {}
  it(name, function()
    local fx = fixture(name)
    local m = make()
    local sd = {}
    for k, v in pairs(fx) do
      local n = k:match("^sd%.(.+)$")
      if n then sd[n] = v end
    end
    m:load_state_dict(sd)
    m:train(o.train ~= false)
    local ins = {}
    local i = 0
    while fx["in" .. i] ~= nil or fx["in" .. i .. "_0"] ~= nil do
      local x = fx["in" .. i]
      if x == nil then
        x = {fx["in" .. i .. "_0"], fx["in" .. i .. "_1"]}
      elseif x.dtype == tensor.int64 then
        x = o.keep_index and x or idx1(x)
      else
        x = x:clone()
        if o.grad_inputs ~= false then x.requires_grad = true end
      end
      ins[i + 1] = x
      i = i + 1
    end
    local outs = {call(m, ins)}
    local flat = {}
    for _, v in ipairs(outs) do
      if type(v) == "table" and not tensor.is_tensor(v) then
        for _, x in ipairs(v) do flat[#flat + 1] = x end
      else
        flat[#flat + 1] = v
      end
    end
    for k = 0, #flat - 1 do
      if fx["out" .. k] ~= nil then assert_close(name .. " out" .. k, flat[k + 1], fx["out" .. k], o.tol) end
    end
    local y = flat[1]
    if y.requires_grad then
      (y * fx.gy):sum():backward()
      for k, x in ipairs(ins) do
        local want = fx["gin" .. (k - 1)]
        if want ~= nil and tensor.is_tensor(x) then assert_close(name .. " gin" .. (k - 1), x.grad, want, o.tol) end
      end
      for _, np in ipairs(m:named_parameters()) do
        local want = fx["grad." .. np[1]]
        if want ~= nil then assert_close(name .. " grad." .. np[1], np[2].grad, want, o.tol) end
      end
    end
    for k, v in pairs(fx) do
      local n = k:match("^after%.(.+)$")
      if n then assert_close(name .. " buffer " .. n, m:state_dict()[n], v, o.tol) end
    end
  end)
end

local function one(m, ins) return m(ins[1]) end

describe("nn layers match PyTorch #unit", function()
  layer_case("conv2d_stride_pad", function() return nn.Conv2d(3, 4, 3, {stride = 2, padding = 1}) end, one)
  layer_case("conv2d_groups_dilation", function() return nn.Conv2d(4, 6, 3, {padding = 2, dilation = 2, groups = 2}) end, one)
  layer_case("conv2d_1x1_nobias", function() return nn.Conv2d(5, 3, 1, {bias = false}) end, one)
  layer_case("conv2d_rect", function() return nn.Conv2d(2, 3, {2, 3}, {stride = {1, 2}, padding = {1, 0}}) end, one)
  layer_case("conv1d", function() return nn.Conv1d(3, 5, 3, {stride = 1, padding = 1}) end, one)
  layer_case("maxpool2d", function() return nn.MaxPool2d(3, {stride = 2, padding = 1}) end, one)
  layer_case("maxpool2d_ceil", function() return nn.MaxPool2d(2, {ceil_mode = true}) end, one)
  layer_case("maxpool2d_dilation", function() return nn.MaxPool2d(2, {stride = 1, dilation = 2}) end, one)
  layer_case("avgpool2d", function() return nn.AvgPool2d(3, {stride = 2, padding = 1}) end, one)
  layer_case("avgpool2d_nopad", function()
    return nn.AvgPool2d(3, {stride = 2, padding = 1, count_include_pad = false, ceil_mode = true})
  end, one)
  layer_case("adaptive_avgpool2d", function() return nn.AdaptiveAvgPool2d({3, 5}) end, one)
  layer_case("adaptive_avgpool2d_1", function() return nn.AdaptiveAvgPool2d(1) end, one)
  layer_case("batchnorm2d_train", function() return nn.BatchNorm2d(3) end, one)
  layer_case("batchnorm2d_eval", function() return nn.BatchNorm2d(3) end, one, {train = false})
  layer_case("batchnorm1d_train", function() return nn.BatchNorm1d(4) end, one)
  layer_case("layernorm", function() return nn.LayerNorm({4, 5}) end, one)
  layer_case("groupnorm", function() return nn.GroupNorm(2, 6) end, one)
  layer_case("embedding", function() return nn.Embedding(10, 4, {padding_idx = 3}) end, one)
  layer_case("embeddingbag_mean_2d", function() return nn.EmbeddingBag(10, 3, {mode = "mean"}) end, one)
  layer_case("embeddingbag_sum_offsets", function() return nn.EmbeddingBag(10, 3, {mode = "sum"}) end,
    function(m, ins) return m(ins[1], ins[2]) end)
  layer_case("embeddingbag_max_offsets", function() return nn.EmbeddingBag(10, 3, {mode = "max"}) end,
    function(m, ins) return m(ins[1], ins[2]) end)
  layer_case("lstm_2layer_batch_first", function() return nn.LSTM(4, 5, {num_layers = 2, batch_first = true}) end, one)
  layer_case("lstm_bidirectional", function() return nn.LSTM(3, 4, {bidirectional = true}) end, one)
  layer_case("gru_2layer", function() return nn.GRU(4, 3, {num_layers = 2}) end, one)
  layer_case("rnn_relu", function() return nn.RNN(3, 4, {nonlinearity = "relu", batch_first = true}) end, one)
  layer_case("lstm_given_state", function() return nn.LSTM(3, 4) end, function(m, ins) return m(ins[1], ins[2]) end,
    {grad_inputs = false})
  layer_case("mha", function() return nn.MultiheadAttention(8, 2) end,
    function(m, ins) return m(ins[1], ins[2], ins[3]) end)
  layer_case("mha_batch_first_mask", function() return nn.MultiheadAttention(8, 4, {batch_first = true}) end,
    function(m, ins) return m(ins[1], ins[2], ins[3]) end)
  layer_case("mha_kdim_vdim", function() return nn.MultiheadAttention(8, 2, {kdim = 5, vdim = 3}) end,
    function(m, ins) return m(ins[1], ins[2], ins[3]) end)
  layer_case("transformer_encoder_layer", function()
    return nn.TransformerEncoderLayer(8, 2, {dim_feedforward = 16, dropout = 0})
  end, one)
  layer_case("transformer_encoder_layer_gelu_norm_first", function()
    return nn.TransformerEncoderLayer(8, 2, {dim_feedforward = 16, dropout = 0, activation = "gelu", norm_first = true,
      batch_first = true})
  end, one)
  layer_case("linear", function() return nn.Linear(5, 3) end, one)
  local acts = {relu = nn.ReLU, gelu = nn.GELU, tanh = nn.Tanh, sigmoid = nn.Sigmoid, silu = nn.SiLU,
                softplus = nn.Softplus}
  for name, cls in pairs(acts) do layer_case("act_" .. name, function() return cls() end, one) end
  layer_case("act_gelu_tanh", function() return nn.GELU({approximate = "tanh"}) end, one)
  layer_case("act_elu", function() return nn.ELU(0.7) end, one)
  layer_case("act_leaky_relu", function() return nn.LeakyReLU(0.2) end, one)
  layer_case("act_softmax", function() return nn.Softmax({dim = 2}) end, one)
  layer_case("act_log_softmax", function() return nn.LogSoftmax({dim = 2}) end, one)
  layer_case("flatten", function() return nn.Flatten() end, one)
end)

describe("nn losses match PyTorch #unit", function()
  local function loss_case(name, fn, kw)
    it(name, function()
      local fx = fixture("loss_" .. name)
      for _, red in ipairs{"none", "mean", "sum"} do
        local x = fx.input:clone()
        x.requires_grad = true
        local t = fx.target
        if t.dtype == tensor.int64 then t = idx1(t) end
        local o = {reduction = red}
        for k, v in pairs(kw or {}) do o[k] = v end
        for k, v in pairs(fx) do
          local n = k:match("^kw%.(.+)$")
          if n then o[n] = v end
        end
        local y = fn(o)(x, t)
        assert_close(name .. " " .. red, y, fx["out_" .. red])
        ;(y * fx["gy_" .. red]):sum():backward()
        assert_close(name .. " grad " .. red, x.grad, fx["gin_" .. red])
      end
    end)
  end
  loss_case("cross_entropy", nn.CrossEntropyLoss)
  loss_case("cross_entropy_weight_smooth_ignore", nn.CrossEntropyLoss, {label_smoothing = 0.1, ignore_index = 2})
  loss_case("cross_entropy_probs", nn.CrossEntropyLoss)
  loss_case("cross_entropy_2d", nn.CrossEntropyLoss)
  loss_case("nll", nn.NLLLoss)
  loss_case("nll_ignore", nn.NLLLoss, {ignore_index = 4})
  loss_case("bce", nn.BCELoss)
  loss_case("bce_logits", nn.BCEWithLogitsLoss)
  loss_case("l1", nn.L1Loss)
  loss_case("mse", nn.MSELoss)
  loss_case("smooth_l1", nn.SmoothL1Loss, {beta = 0.5})
  loss_case("huber", nn.HuberLoss, {delta = 0.7})
  loss_case("kl_div", nn.KLDivLoss)
  loss_case("kl_div_log_target", nn.KLDivLoss, {log_target = true})
  it("kl_div batchmean", function()
    local fx = fixture("loss_kl_div_batchmean")
    local x = fx.input:clone()
    x.requires_grad = true
    local y = nn.KLDivLoss{reduction = "batchmean"}(x, fx.target)
    assert_close("batchmean", y, fx.out)
    y:backward()
    assert_close("batchmean grad", x.grad, fx.gin)
  end)
end)

describe("optim matches PyTorch #unit", function()
  local function optim_case(name, make, g1, g2)
    it(name, function()
      local fx = fixture("optim_" .. name)
      local p1, p2 = fx.p1_0:clone(), fx.p2_0:clone()
      p1.requires_grad, p2.requires_grad = true, true
      local a, b = {params = {p1}}, {params = {p2}}
      for k, v in pairs(g1 or {}) do a[k] = v end
      for k, v in pairs(g2 or {}) do b[k] = v end
      local opt = make({a, b})
      for s = 1, 4 do
        p1.grad, p2.grad = fx["g1_" .. s], fx["g2_" .. s]
        opt:step()
        assert_close(name .. " p1 step " .. s, p1, fx["p1_" .. s], 1e-5)
        assert_close(name .. " p2 step " .. s, p2, fx["p2_" .. s], 1e-5)
        if s == 2 then
          -- a state_dict round trip into a fresh optimizer continues identically
          local sd = opt:state_dict()
          opt = make({a, b})
          opt:load_state_dict(sd)
        end
      end
    end)
  end
  optim_case("sgd", function(g) return optim.SGD(g, {lr = 0.1}) end, {}, {lr = 0.05})
  optim_case("sgd_momentum_nesterov_wd", function(g)
    return optim.SGD(g, {lr = 0.1, momentum = 0.9, nesterov = true, weight_decay = 0.01})
  end, {}, {momentum = 0.5})
  optim_case("sgd_dampening", function(g) return optim.SGD(g, {lr = 0.1, momentum = 0.9, dampening = 0.3}) end)
  optim_case("adam", function(g) return optim.Adam(g, {lr = 0.01}) end, {}, {lr = 0.1, betas = {0.8, 0.99}})
  optim_case("adam_amsgrad_wd", function(g) return optim.Adam(g, {lr = 0.01, amsgrad = true, weight_decay = 0.1}) end)
  optim_case("adamw", function(g) return optim.AdamW(g, {lr = 0.01}) end, {}, {weight_decay = 0.5})
  optim_case("rmsprop", function(g) return optim.RMSprop(g, {lr = 0.01}) end, {}, {alpha = 0.9})
  optim_case("rmsprop_centered_momentum", function(g)
    return optim.RMSprop(g, {lr = 0.01, centered = true, momentum = 0.9, weight_decay = 0.1})
  end)
  optim_case("adagrad", function(g) return optim.Adagrad(g, {lr = 0.1, initial_accumulator_value = 0.2}) end, {},
    {lr_decay = 0.1})
end)

describe("lr_scheduler matches PyTorch #unit", function()
  local S = optim.lr_scheduler
  local cases = {
    step = function(o) return S.StepLR(o, 3, {gamma = 0.5}) end,
    multistep = function(o) return S.MultiStepLR(o, {2, 5, 9}, {gamma = 0.3}) end,
    exponential = function(o) return S.ExponentialLR(o, 0.9) end,
    cosine = function(o) return S.CosineAnnealingLR(o, 10, {eta_min = 0.01}) end,
    lambda = function(o) return S.LambdaLR(o, function(e) return 1 / (e + 1) end) end,
  }
  for name, make in pairs(cases) do
    it(name, function()
      local want = fixture("sched_" .. name).lrs:totable()
      local p = tensor.zeros(1, {requires_grad = true})
      local opt = optim.SGD({p}, {lr = 0.5})
      local s = make(opt)
      for e = 1, #want do
        assert.is_true(math.abs(opt.param_groups[1].lr - want[e]) < 1e-12,
          ("%s epoch %d: lr %g, PyTorch %g"):format(name, e - 1, opt.param_groups[1].lr, want[e]))
        opt:step()
        s:step()
      end
    end)
  end
end)

describe("distributions match PyTorch #unit", function()
  it("Categorical, Normal, Bernoulli log_prob and entropy", function()
    local fx = fixture("distributions")
    local D = tensor.distributions
    local c = D.Categorical{logits = fx.cat_logits}
    assert_close("cat probs", c.probs, fx.cat_probs)
    assert_close("cat log_prob", c:log_prob(idx1(fx.cat_value)), fx.cat_log_prob)
    assert_close("cat entropy", c:entropy(), fx.cat_entropy)
    local c2 = D.Categorical(fx.cat_probs)
    assert_close("cat from probs", c2:log_prob(idx1(fx.cat_value)), fx.cat_log_prob)
    local n = D.Normal(fx.normal_loc, fx.normal_scale)
    assert_close("normal log_prob", n:log_prob(fx.normal_value), fx.normal_log_prob)
    assert_close("normal entropy", n:entropy(), fx.normal_entropy)
    local b = D.Bernoulli{probs = fx.bern_probs}
    assert_close("bernoulli log_prob", b:log_prob(fx.bern_value), fx.bern_log_prob)
    assert_close("bernoulli entropy", b:entropy(), fx.bern_entropy)
  end)
end)
