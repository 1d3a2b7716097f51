-- rpchost.nn.rnn: RNN, LSTM and GRU as PyTorch has them: parameter names
-- weight_ih_l{k}[_reverse], weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k}; gate
-- order i, f, g, o (LSTM) and r, z, n (GRU); multi-layer, bidirectional,
-- batch_first, dropout between layers; uniform(+-1/sqrt(hidden_size)) init.
-- The input-to-hidden products of all time steps are one GEMM per layer and
-- direction (the gates fused in one [4H, in] matrix); each step then does one
-- [B, H] x [H, 4H] GEMM for the recurrent part.
local tensor = require "rpchost.tensor"
local mod = require "rpchost.nn.module"
local F = require "rpchost.nn.functional"
local init = require "rpchost.nn.init"

local Module = mod.Module
local R = {}

local GATES = {RNN_TANH = 1, RNN_RELU = 1, LSTM = 4, GRU = 3}

local function rnn_init(self, kind, input_size, hidden_size, ...)
  local o = F._opts_of(...)
  if type(input_size) ~= "number" or type(hidden_size) ~= "number" then
    error(("%s(input_size, hidden_size): expected two numbers"):format(self.name), 4)
  end
  mod.refuse(self.name, o, {"proj_size"})
  self.mode = kind
  self.input_size, self.hidden_size = input_size, hidden_size
  self.num_layers = o.num_layers or 1
  self.bias = o.bias ~= false
  self.batch_first = o.batch_first and true or false
  self.dropout = o.dropout or 0
  self.bidirectional = o.bidirectional and true or false
  self.proj_size = 0
  local g = GATES[kind]
  local dirs = self.bidirectional and 2 or 1
  local dt = {dtype = o.dtype or tensor.get_default_dtype(), device = o.device}
  for l = 0, self.num_layers - 1 do
    for d = 0, dirs - 1 do
      local sfx = ("_l%d%s"):format(l, d == 1 and "_reverse" or "")
      local nin = l == 0 and input_size or hidden_size * dirs
      self:register_parameter("weight_ih" .. sfx, tensor.empty({g * hidden_size, nin}, dt))
      self:register_parameter("weight_hh" .. sfx, tensor.empty({g * hidden_size, hidden_size}, dt))
      if self.bias then
        self:register_parameter("bias_ih" .. sfx, tensor.empty({g * hidden_size}, dt))
        self:register_parameter("bias_hh" .. sfx, tensor.empty({g * hidden_size}, dt))
      end
    end
  end
  self:reset_parameters()
end

local function reset(self)
  local b = 1 / math.sqrt(self.hidden_size)
  for _, p in ipairs(self:parameters()) do init.uniform_(p, -b, b) end
end

local function repr(self)
  local s = ("%d, %d"):format(self.input_size, self.hidden_size)
  if self.num_layers ~= 1 then s = s .. ", num_layers=" .. self.num_layers end
  if self.mode == "RNN_RELU" then s = s .. ", nonlinearity='relu'" end
  if not self.bias then s = s .. ", bias=False" end
  if self.batch_first then s = s .. ", batch_first=True" end
  if self.dropout ~= 0 then s = s .. ", dropout=" .. tostring(self.dropout) end
  if self.bidirectional then s = s .. ", bidirectional=True" end
  return s
end

-- The LSTM cell's pointwise part as one autograd node (the lstm_cell rule of
-- rpchost.autograd.rules): from the pre-activation gates [B, 4H] and c_prev to
-- (h, c), one pass in C each way (host/tensor/nn/nn_rnn.c) that saves one
-- [B, 5H] block for the backward, instead of narrow/sigmoid/tanh/mul nodes each
-- saving and scattering tensors of their own.
local core = require "rpchost.core"
local autograd = require "rpchost.autograd.engine"
local rules = require "rpchost.autograd.rules"
local function lstm_cell_native(gates, c_prev)
  local h, c, ws = core.nn_lstm_cell(gates, c_prev)
  if not autograd.wants(gates, c_prev) then return h, c end
  local outs = autograd.record_n(rules.lstm_cell, {n = 2, h, c}, {n = 2, gates, c_prev}, {c_prev, ws})
  return outs[1], outs[2]
end

-- the cell in tensor ops, for dtypes the kernels do not take
local function lstm_cell_ops(gates, c_prev)
  local H = c_prev:size(2)
  local i = gates:narrow(2, 1, H):sigmoid()
  local f = gates:narrow(2, H + 1, H):sigmoid()
  local g = gates:narrow(2, 2 * H + 1, H):tanh()
  local o = gates:narrow(2, 3 * H + 1, H):sigmoid()
  local c = f * c_prev + i * g
  return o * c:tanh(), c
end

local function lstm_cell(gates, c_prev)
  -- host/tensor/nn/nn_rnn.c on the host, nn_cuda_norm.c (kernels/norm.cu) on a device
  if (gates.dtype == tensor.float32 or gates.dtype == tensor.float64) and c_prev.device == gates.device then
    return lstm_cell_native(gates, c_prev)
  end
  return lstm_cell_ops(gates, c_prev)
end

-- A whole LSTM layer (one direction) as one autograd node on host float
-- tensors (the lstm_layer rule of rpchost.autograd.rules): the forward saves,
-- per step, the cell's [B, 5H] block and c_prev (and the outputs, which are the
-- next steps' h_prev) instead of a graph of nodes per step; the backward runs
-- the steps back with one [B, 4H] x [4H, H] product each, keeps every step's
-- gate gradients in one [T, B, 4H] tensor, and then gets the weights' and the
-- input's gradients as one GEMM each over all steps (not 2 x T thin per-step
-- products and T accumulations of a [4H, H] gradient). The forward runs
-- unrecorded; its by-products go to the node (args).
local function lstm_layer_forward(x, wih, whh, bih, bhh, h0, c0, reverse)
  local T, B, H = x:size(1), x:size(2), whh:size(2)
  local xi = x:reshape(T * B, x:size(3)):matmul(wih:t())
  if bih ~= nil then xi:add_(bih + bhh) end
  xi = xi:view(T, B, 4 * H)
  local whh_t = whh:t()
  local out = tensor.empty({T, B, H}, {dtype = x.dtype})
  local ws, cs = {}, {}
  local h, c = h0, c0
  for s = 1, T do
    local t = reverse and (T - s + 1) or s
    local gates = h:matmul(whh_t):add_(xi:select(1, t))
    local hn, cn, w = core.nn_lstm_cell(gates, c)
    ws[t], cs[t] = w, c
    out:select(1, t):copy_(hn)
    h, c = hn, cn
  end
  return out, h, c, ws, cs
end
local function lstm_layer_native(x, wih, whh, bih, bhh, h0, c0, reverse)
  local wants = autograd.wants
  if not (wants(x, wih, whh) or wants(bih, bhh, h0) or wants(c0)) then
    local out, h, c = lstm_layer_forward(x, wih, whh, bih, bhh, h0, c0, reverse)
    return out, h, c
  end
  local out, h, c, ws, cs = autograd.no_grad(lstm_layer_forward, x, wih, whh, bih, bhh, h0, c0, reverse)
  local outs = autograd.record_n(rules.lstm_layer, {n = 3, out, h, c}, {n = 7, x, wih, whh, bih, bhh, h0, c0},
    {x, wih, whh, h0, out, ws, cs, reverse})
  return outs[1], outs[2], outs[3]
end

local function native_lstm(x, wih, whh, bih)
  local ok = x.device == "cpu" and (x.dtype == tensor.float32 or x.dtype == tensor.float64)
  return ok and wih.dtype == x.dtype and whh.dtype == x.dtype and (bih == nil or bih.dtype == x.dtype)
end

-- one layer, one direction over x [T, B, in]: outputs [T, B, H] and the final state
local function run_direction(self, x, sfx, h, c, reverse)
  local T, B = x:size(1), x:size(2)
  local H = self.hidden_size
  local g = GATES[self.mode]
  local wih, whh = self["weight_ih" .. sfx], self["weight_hh" .. sfx]
  local bih, bhh = self["bias_ih" .. sfx], self["bias_hh" .. sfx]
  if self.mode == "LSTM" and native_lstm(x, wih, whh, bih) and h.dtype == x.dtype and c.dtype == x.dtype then
    return lstm_layer_native(x, wih, whh, bih, bhh, h, c, reverse and true or false)
  end
  -- all time steps' input products at once: [T*B, in] x [in, gH]
  local xi = x:reshape(T * B, x:size(3)):matmul(wih:t())
  if bih ~= nil then
    if self.mode == "GRU" then xi = xi + bih else xi = xi + (bih + bhh) end
  end
  xi = xi:view(T, B, g * H)
  local whh_t = whh:t()
  local outs = {}
  -- one node for all steps' slices (select per step would give each step's
  -- backward a full [T, B, gH] gradient to scatter into)
  local steps = {xi:unbind(1)}
  if #steps == 1 and type(steps[1]) == "table" then steps = steps[1] end
  for s = 1, T do
    local t = reverse and (T - s + 1) or s
    local gi = steps[t]
    if self.mode == "LSTM" then
      h, c = lstm_cell(gi + h:matmul(whh_t), c)
    elseif self.mode == "GRU" then
      local gh = h:matmul(whh_t)
      if bhh ~= nil then gh = gh + bhh end
      local r = (gi:narrow(2, 1, H) + gh:narrow(2, 1, H)):sigmoid()
      local z = (gi:narrow(2, H + 1, H) + gh:narrow(2, H + 1, H)):sigmoid()
      local n = (gi:narrow(2, 2 * H + 1, H) + r * gh:narrow(2, 2 * H + 1, H)):tanh()
      h = (1 - z) * n + z * h
    else
      local a = gi + h:matmul(whh_t)
      h = self.mode == "RNN_RELU" and a:relu() or a:tanh()
    end
    outs[t] = h
  end
  return tensor.stack(outs, 1), h, c
end

-- forward(input, hx): input [T, B, in] ([B, T, in] with batch_first, [T, in]
-- unbatched); hx = h0 (RNN, GRU) or {h0, c0} (LSTM), each [layers*dirs, B, H].
-- Returns output, h_n (RNN, GRU) or output, {h_n, c_n} (LSTM).
local function forward(self, x, hx)
  if not tensor.is_tensor(x) or (x:dim() ~= 3 and x:dim() ~= 2) or x:size(x:dim()) ~= self.input_size then
    self:shape_error(self.batch_first and ("[N, L, %d]"):format(self.input_size)
      or ("[L, N, %d]"):format(self.input_size), x)
  end
  local unbatched = x:dim() == 2
  if unbatched then x = x:unsqueeze(2)
  elseif self.batch_first then x = x:transpose(1, 2) end
  local B = x:size(2)
  local H = self.hidden_size
  local dirs = self.bidirectional and 2 or 1
  local lstm = self.mode == "LSTM"
  local h0, c0
  if hx ~= nil then
    if lstm then
      if type(hx) ~= "table" or tensor.is_tensor(hx) then error("LSTM: hx must be {h_0, c_0}", 2) end
      h0, c0 = hx[1], hx[2]
    else
      h0 = hx
    end
    if unbatched then h0 = h0:unsqueeze(2); c0 = c0 and c0:unsqueeze(2) end
    local want = ("[%d, %d, %d]"):format(self.num_layers * dirs, B, H)
    local function chk(t, what)
      if not tensor.is_tensor(t) or t:dim() ~= 3 or t:size(1) ~= self.num_layers * dirs or t:size(2) ~= B or
          t:size(3) ~= H then
        error(("%s: expected %s size %s, got %s"):format(rawget(self, "_sig") or self.name, what, want,
          tensor.is_tensor(t) and F._shape_str(t) or type(t)), 4)
      end
    end
    chk(h0, "hidden[0]")
    if lstm then chk(c0, "hidden[1]") end
  end
  local zeros = function() return tensor.zeros(B, H, {dtype = x.dtype, device = x.device}) end
  local hn, cn = {}, {}
  local layer_in = x
  for l = 0, self.num_layers - 1 do
    local outs = {}
    for d = 0, dirs - 1 do
      local k = l * dirs + d + 1
      local h = h0 and h0:select(1, k) or zeros()
      local c = lstm and (c0 and c0:select(1, k) or zeros()) or nil
      local sfx = ("_l%d%s"):format(l, d == 1 and "_reverse" or "")
      local o, hl, cl = run_direction(self, layer_in, sfx, h, c, d == 1)
      outs[#outs + 1] = o
      hn[k], cn[k] = hl, cl
    end
    layer_in = #outs == 1 and outs[1] or tensor.cat(outs, 3)
    if self.dropout > 0 and self.training and l < self.num_layers - 1 then
      layer_in = F.dropout(layer_in, self.dropout, true)
    end
  end
  local out = layer_in
  local h_n = tensor.stack(hn, 1)
  local c_n = lstm and tensor.stack(cn, 1) or nil
  if unbatched then
    out = out:squeeze(2)
    h_n = h_n:squeeze(2)
    c_n = c_n and c_n:squeeze(2)
  elseif self.batch_first then
    out = out:transpose(1, 2)
  end
  if lstm then return out, {h_n, c_n} end
  return out, h_n
end

-- RNN(input_size, hidden_size, {num_layers, nonlinearity = "tanh", bias,
-- batch_first, dropout, bidirectional})
R.RNN = Module:extend("RNN")
function R.RNN:__init(i, h, ...)
  local o = F._opts_of(...)
  local nl = o.nonlinearity or "tanh"
  if nl ~= "tanh" and nl ~= "relu" then error("RNN: unknown nonlinearity '" .. tostring(nl) .. "'", 3) end
  rnn_init(self, nl == "relu" and "RNN_RELU" or "RNN_TANH", i, h, ...)
end
R.LSTM = Module:extend("LSTM")
function R.LSTM:__init(...) rnn_init(self, "LSTM", ...) end
R.GRU = Module:extend("GRU")
function R.GRU:__init(...) rnn_init(self, "GRU", ...) end
for _, c in ipairs{R.RNN, R.LSTM, R.GRU} do
  c.reset_parameters, c.forward, c.extra_repr = reset, forward, repr
end

-- cells: one step; forward(x [B, in] or [in], hx) -> h' (or {h', c'} for LSTMCell)
local function cell(name, kind)
  local cls = Module:extend(name)
  function cls:__init(i, h, ...)
    local o = F._opts_of(...)
    self.input_size, self.hidden_size, self.bias = i, h, o.bias ~= false
    self.mode = kind == "RNN" and ((o.nonlinearity == "relu") and "RNN_RELU" or "RNN_TANH") or kind
    local g = GATES[self.mode]
    local dt = {dtype = o.dtype or tensor.get_default_dtype()}
    self:register_parameter("weight_ih", tensor.empty({g * h, i}, dt))
    self:register_parameter("weight_hh", tensor.empty({g * h, h}, dt))
    if self.bias then
      self:register_parameter("bias_ih", tensor.empty({g * h}, dt))
      self:register_parameter("bias_hh", tensor.empty({g * h}, dt))
    end
    reset(self)
  end
  function cls:forward(x, hx)
    local want = ("[N, %d] or [%d]"):format(self.input_size, self.input_size)
    if not tensor.is_tensor(x) or (x:dim() ~= 2 and x:dim() ~= 1) or x:size(x:dim()) ~= self.input_size then
      self:shape_error(want, x)
    end
    if x:dim() == 1 then
      -- one unbatched step, as PyTorch's cells take it: the state is [H] too
      local function batched(t, what)
        if t == nil then return nil end
        if not tensor.is_tensor(t) or t:dim() ~= 1 or t:size(1) ~= self.hidden_size then
          error(("%s: an unbatched input [%d] takes an unbatched %s [%d], got %s"):format(name,
            self.input_size, what, self.hidden_size, tensor.is_tensor(t) and tostring(t:size()) or type(t)), 3)
        end
        return t:unsqueeze(1)
      end
      local h1
      if self.mode == "LSTM" then
        h1 = hx and {batched(hx[1], "h_0"), batched(hx[2], "c_0")}
      else
        h1 = batched(hx, "hx")
      end
      local out = self:forward(x:unsqueeze(1), h1)
      if self.mode == "LSTM" then return {out[1]:squeeze(1), out[2]:squeeze(1)} end
      return out:squeeze(1)
    end
    local B = x:size(1)
    local z = function() return tensor.zeros(B, self.hidden_size, {dtype = x.dtype}) end
    local h, c
    if self.mode == "LSTM" then h, c = hx and hx[1] or z(), hx and hx[2] or z()
    else h = hx or z() end
    local _, hn, cn = run_direction(self, x:unsqueeze(1), "", h, c, false)
    if self.mode == "LSTM" then return {hn, cn} end
    return hn
  end
  cls.extra_repr = function(self) return ("%d, %d"):format(self.input_size, self.hidden_size) end
  return cls
end
R.RNNCell = cell("RNNCell", "RNN")
R.LSTMCell = cell("LSTMCell", "LSTM")
R.GRUCell = cell("GRUCell", "GRU")

return R
