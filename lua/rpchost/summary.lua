-- rpchost.summary: the face of SummaryWriter (torch.utils.tensorboard's), the
-- module name scripts ask for; the writer is rpchost.nn.summary.
return require "rpchost.nn.summary"
