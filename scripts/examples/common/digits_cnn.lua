-- examples/common/digits_cnn.lua: the network of pytorch/examples' parameter
-- server tutorial (rpc_parameter_server.py's MNIST CNN), sized for the 8x8
-- digits that stand in for MNIST here (digits.lua): after two 3x3
-- convolutions and a 2x2 max-pool an image is 64 x 2 x 2 features, so the
-- first Linear takes 256 instead of MNIST's 9216. The parameter-server example
-- trains it; bench/ps_step.lua times its step.
local nn = require "nn"
local F = nn.functional

local Net = nn.Module:extend("Net")
function Net:init()
  self.conv1 = nn.Conv2d(1, 32, 3, 1)
  self.conv2 = nn.Conv2d(32, 64, 3, 1)
  self.dropout1 = nn.Dropout2d(0.25)
  self.dropout2 = nn.Dropout2d(0.5)
  self.fc1 = nn.Linear(256, 128)
  self.fc2 = nn.Linear(128, 10)
end
function Net:forward(x)
  x = self.conv1(x)
  x = F.relu(x)
  x = self.conv2(x)
  x = F.max_pool2d(x, 2)
  x = self.dropout1(x)
  x = x:flatten(2)
  x = self.fc1(x)
  x = F.relu(x)
  x = self.dropout2(x)
  x = self.fc2(x)
  return F.log_softmax(x, 2)
end

return Net
