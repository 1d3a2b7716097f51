-- dist_autograd: the face of torch.distributed.autograd (API.md,
-- docs/dist_autograd.md): contexts, backward across workers and their gradients,
-- kept in rpchost.rpc.dist_autograd (the engine, in the rpc layer).
return require "rpchost.rpc.dist_autograd"
