-- examples/parameter_server/ps_server.lua: the tutorial's parameter server and its
-- RRef helpers, shared by main.lua (the example) and bench/ps_step.lua (which
-- times the example's step, so it must run exactly this code).
--   require "ps_server"  -- (with this folder and ../common on package.path)
-- Defines globals, as the tutorial's module-level definitions are: RPC finds a
-- function sent by reference through the global it is reachable from, on every
-- rank that loaded this file. ParameterServer.seed (1) seeds the model.
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local dist_autograd = require "dist_autograd"

-- the tutorial's MNIST network, sized for 8x8 inputs (../common/digits_cnn.lua)
Net = require "digits_cnn"

-- call_method / remote_method: a method of the object an RRef holds, run on its owner
function call_method(method, rref, ...) return method(rref:local_value(), ...) end
function remote_method(method, rref, ...)
  return rpc.rpc_sync(rref:owner(), call_method, table.pack(method, rref, ...))
end

-- With several trainers, one trainer's optimizer step changes the weights in
-- place while another trainer's backward still needs the values its forward used:
-- the tutorial as written then fails with "modified by an inplace operation", in
-- PyTorch as here (pytorch/tutorials#2095). So each forward runs on clones of the
-- weights taken as it starts: the gradients still reach the weights (a clone is
-- differentiable), and each backward sees its own forward's values, which is the
-- asynchronous SGD a parameter server means. The twin does the same.
function forward_on_clones(model, inp)
  local now = {}
  for _, np in ipairs(model:named_parameters()) do now[np[1]] = np[2]:clone() end
  return nn.utils.stateless.functional_call(model, now, inp)
end

ParameterServer = nn.Module:extend("ParameterServer")
ParameterServer.seed = 1
function ParameterServer:init()
  tensor.manual_seed(ParameterServer.seed)
  self.model = Net()
end
function ParameterServer:forward(inp) return forward_on_clones(self.model, inp) end
function ParameterServer:get_dist_gradients(cid) return dist_autograd.get_gradients(cid) end
function ParameterServer:get_param_rrefs()
  local out = {}
  for i, p in ipairs(self.model:parameters()) do out[i] = rpc.RRef(p) end
  return out
end
function ParameterServer:train_mode(mode) self.model:train(mode) return true end

-- one server per process, however many trainers ask for it
param_server = nil
function get_parameter_server()
  if not param_server then param_server = ParameterServer() end
  return param_server
end
