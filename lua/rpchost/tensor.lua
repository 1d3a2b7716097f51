-- rpchost.tensor: PyTorch-style tensors for Lua over the C core (see API.md), the
-- tensor layer's API as the layers above it use it (the face `tensor` adds
-- tensor.data and tensor.distributions, which stand on nn).
--
-- The API is assembled here, in this one order (lua-resty-core's resty/core.lua
-- is the model): the Tensor itself, then each family of ops, a flat file of
-- functions that extends the same tensor table, then autograd's part. A later
-- step may stand on an earlier one (indexing puts t[k] in front of base's
-- fields; autograd's in-place rule wraps every in-place op the families made);
-- nothing else patches the API.
local tensor = require "rpchost.tensor.base" -- dtypes, Size, creation, fields, printing, devices
require "rpchost.tensor.shape"               -- views, copies, dtype and device moves, cat/split...
require "rpchost.tensor.math"                -- element-wise, reductions, softmax, sort, matmul, einsum
require "rpchost.tensor.indexing"            -- t[k], narrow/select, gather/scatter, masks, writes
require "rpchost.tensor.random"              -- rand, randn, randint, randperm, bernoulli, multinomial
require "rpchost.tensor.io"                  -- save/load (.npy)
require("rpchost.tensor.wire").install(tensor) -- how tensors travel in RPC messages
-- last: requires_grad, grad, backward, detach, no_grad..., and the one in-place
-- rule on every in-place op (rpchost.autograd.engine; the derivatives are in
-- rpchost.autograd.rules)
require("rpchost.autograd.engine").install(tensor, require "rpchost.autograd.rules")

return tensor
