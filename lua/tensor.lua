-- tensor: the face of the tensor API (API.md, docs/tensor.md). The tensors, their
-- ops and autograd are assembled in rpchost.tensor (the tensor layer); this face
-- adds what stands above that layer: tensor.distributions and tensor.data
-- (datasets, DataLoader, samplers), which use nn's functions and the process group.
local tensor = require "rpchost.tensor"
require("rpchost.nn.distributions").install(tensor)
require("rpchost.nn.data").install(tensor)
return tensor
