-- rpchost.nn.attention: MultiheadAttention and TransformerEncoderLayer with
-- PyTorch's parameters (in_proj_weight, in_proj_bias, out_proj.weight/bias;
-- self_attn, linear1, linear2, norm1, norm2), initialisation and masks
-- (bool masks: true = not allowed; float masks are added to the scores).
local tensor = require "rpchost.tensor"
local mod = require "rpchost.nn.module"
local F = require "rpchost.nn.functional"
local init = require "rpchost.nn.init"
local L = require "rpchost.nn.layers"

local Module = mod.Module
local A = {}

-- MultiheadAttention(embed_dim, num_heads, {dropout = 0, bias = true, batch_first = false,
-- kdim = embed_dim, vdim = embed_dim})
A.MultiheadAttention = Module:extend("MultiheadAttention")
function A.MultiheadAttention:__init(e, heads, ...)
  local o = F._opts_of(...)
  if type(e) ~= "number" or type(heads) ~= "number" then
    error("MultiheadAttention(embed_dim, num_heads): expected two numbers", 3)
  end
  mod.refuse("MultiheadAttention", o, {"add_bias_kv", "add_zero_attn"})
  if e % heads ~= 0 then error("MultiheadAttention: embed_dim must be divisible by num_heads", 3) end
  self.embed_dim, self.num_heads, self.head_dim = e, heads, e / heads
  self.dropout, self.batch_first = o.dropout or 0, o.batch_first and true or false
  local dt = {dtype = o.dtype or tensor.get_default_dtype()}
  -- keys and values of other widths (kdim, vdim) get their own projections,
  -- under PyTorch's names, instead of the one packed in_proj_weight
  self.kdim, self.vdim = o.kdim or e, o.vdim or e
  self._qkv_same_embed_dim = self.kdim == e and self.vdim == e
  if self._qkv_same_embed_dim then
    self:register_parameter("in_proj_weight", tensor.empty({3 * e, e}, dt))
  else
    self:register_parameter("q_proj_weight", tensor.empty({e, e}, dt))
    self:register_parameter("k_proj_weight", tensor.empty({e, self.kdim}, dt))
    self:register_parameter("v_proj_weight", tensor.empty({e, self.vdim}, dt))
  end
  if o.bias ~= false then self:register_parameter("in_proj_bias", tensor.zeros(3 * e, dt)) end
  self.out_proj = L.Linear(e, e, {bias = o.bias ~= false, dtype = dt.dtype})
  if self._qkv_same_embed_dim then
    init.xavier_uniform_(self.in_proj_weight)
  else
    init.xavier_uniform_(self.q_proj_weight)
    init.xavier_uniform_(self.k_proj_weight)
    init.xavier_uniform_(self.v_proj_weight)
  end
  if self.in_proj_bias ~= nil then
    init.constant_(self.in_proj_bias, 0)
    init.constant_(self.out_proj.bias, 0)
  end
end
function A.MultiheadAttention:extra_repr() return "" end

local function mask_scores(scores, mask)
  if mask == nil then return scores end
  if mask.dtype == tensor.bool then return scores:masked_fill(mask, -math.huge) end
  return scores + mask
end

-- forward(query, key, value, {key_padding_mask =, need_weights = true, attn_mask =,
-- average_attn_weights = true}) -> attn_output, attn_weights (nil unless need_weights)
function A.MultiheadAttention:forward(q, k, v, o)
  o = o or {}
  k, v = k or q, v or k or q
  local e, h, hd = self.embed_dim, self.num_heads, self.head_dim
  if not tensor.is_tensor(q) or (q:dim() ~= 3 and q:dim() ~= 2) or q:size(q:dim()) ~= e then
    self:shape_error(self.batch_first and ("[N, L, %d]"):format(e) or ("[L, N, %d]"):format(e), q)
  end
  for _, kv in ipairs({{k, self.kdim, "key"}, {v, self.vdim, "value"}}) do
    local t, width = kv[1], kv[2]
    if not tensor.is_tensor(t) or t:dim() ~= q:dim() or t:size(t:dim()) ~= width then
      error(("MultiheadAttention: expected the %s to be %d-d with %d features (kdim/vdim), got %s"):format(kv[3],
        q:dim(), width, tensor.is_tensor(t) and tostring(t:size()) or type(t)), 2)
    end
  end
  local unbatched = q:dim() == 2
  if unbatched then
    q, k, v = q:unsqueeze(2), k:unsqueeze(2), v:unsqueeze(2)
  elseif self.batch_first then
    q, k, v = q:transpose(1, 2), k:transpose(1, 2), v:transpose(1, 2)
  end
  local tl, n, s = q:size(1), q:size(2), k:size(1)
  local w, b = self.in_proj_weight, self.in_proj_bias
  local sep = not self._qkv_same_embed_dim and {self.q_proj_weight, self.k_proj_weight, self.v_proj_weight}
  local function proj(x, i)
    return F.linear(x, sep and sep[i + 1] or w:narrow(1, i * e + 1, e), b and b:narrow(1, i * e + 1, e))
  end
  -- [T, N, E] -> [N*h, T, hd]
  local function heads_of(x, t) return x:reshape(t, n * h, hd):transpose(1, 2) end
  local qh = heads_of(proj(q, 0), tl) / math.sqrt(hd)
  local kh, vh = heads_of(proj(k, 1), s), heads_of(proj(v, 2), s)
  local scores = qh:bmm(kh:transpose(2, 3)) -- [N*h, T, S]
  if o.attn_mask ~= nil then
    local m = o.attn_mask
    if m:dim() == 2 then m = m:unsqueeze(1) end
    scores = mask_scores(scores, m)
  end
  if o.key_padding_mask ~= nil then
    local kpm = o.key_padding_mask
    if unbatched then kpm = kpm:unsqueeze(1) end
    local m4 = kpm:view(n, 1, 1, s)
    scores = mask_scores(scores:view(n, h, tl, s), m4):view(n * h, tl, s)
  end
  local attn = F.softmax(scores, 3)
  if self.dropout > 0 and self.training then attn = F.dropout(attn, self.dropout, true) end
  local out = attn:bmm(vh):transpose(1, 2):reshape(tl, n, e)
  out = self.out_proj(out)
  if unbatched then out = out:squeeze(2)
  elseif self.batch_first then out = out:transpose(1, 2) end
  if o.need_weights == false then return out, nil end
  local aw = attn:view(n, h, tl, s)
  if o.average_attn_weights ~= false then aw = aw:mean(2) end
  if unbatched then aw = aw:squeeze(1) end
  return out, aw
end

-- TransformerEncoderLayer(d_model, nhead, {dim_feedforward = 2048, dropout = 0.1,
-- activation = "relu" | "gelu", layer_norm_eps = 1e-5, batch_first = false, norm_first = false})
A.TransformerEncoderLayer = Module:extend("TransformerEncoderLayer")
function A.TransformerEncoderLayer:__init(d, nhead, ...)
  local o = F._opts_of(...)
  local ff, p = o.dim_feedforward or 2048, o.dropout or 0.1
  self.self_attn = A.MultiheadAttention(d, nhead, {dropout = p, batch_first = o.batch_first})
  self.linear1 = L.Linear(d, ff)
  self.dropout = L.Dropout(p)
  self.linear2 = L.Linear(ff, d)
  self.norm_first = o.norm_first and true or false
  self.norm1 = L.LayerNorm(d, {eps = o.layer_norm_eps or 1e-5})
  self.norm2 = L.LayerNorm(d, {eps = o.layer_norm_eps or 1e-5})
  self.dropout1 = L.Dropout(p)
  self.dropout2 = L.Dropout(p)
  local act = o.activation or "relu"
  if act ~= "relu" and act ~= "gelu" then
    error("TransformerEncoderLayer: activation should be relu/gelu, not " .. tostring(act), 3)
  end
  self.activation = act
end
-- forward(src, {src_mask =, src_key_padding_mask =}) (also forward(src, mask))
function A.TransformerEncoderLayer:forward(x, o)
  if tensor.is_tensor(o) then o = {src_mask = o} end
  o = o or {}
  local act = self.activation == "gelu" and F.gelu or F.relu
  local function sa(y)
    local out = self.self_attn(y, y, y, {attn_mask = o.src_mask, key_padding_mask = o.src_key_padding_mask,
      need_weights = false})
    return self.dropout1(out)
  end
  local function ffn(y) return self.dropout2(self.linear2(self.dropout(act(self.linear1(y))))) end
  if self.norm_first then
    x = x + sa(self.norm1(x))
    x = x + ffn(self.norm2(x))
  else
    x = self.norm1(x + sa(x))
    x = self.norm2(x + ffn(x))
  end
  return x
end

-- TransformerEncoder(encoder_layer, num_layers, {norm =}): deep copies of the layer
A.TransformerEncoder = Module:extend("TransformerEncoder")
function A.TransformerEncoder:__init(layer, n, o)
  o = o or {}
  self.layers = L.ModuleList()
  for _ = 1, n do self.layers:append(mod.deepcopy(layer)) end
  self.num_layers = n
  if o.norm then self.norm = o.norm end
end
function A.TransformerEncoder:forward(x, o)
  for _, l in ipairs(self.layers:children()) do x = l(x, o) end
  if self.norm then x = self.norm(x) end
  return x
end

return A
