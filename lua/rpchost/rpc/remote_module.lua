-- rpchost.rpc.remote_module: rpc.RemoteModule, PyTorch's
-- torch.distributed.nn.RemoteModule. The module is built on its owner (the
-- worker named by `remote_device`, "worker1" or "worker1/cpu" or
-- "worker1/cuda:0") and lives behind an RRef there; the local object only
-- forwards calls. forward runs the owner's forward through rpc_sync (so inside a
-- dist_autograd context the gradients flow back to the owner's parameters),
-- forward_async through rpc_async, and remote_parameters hands out the
-- parameters as RRefs owned there, the list DistributedOptimizer takes.
-- Like PyTorch's, it has no parameters() of its own: they are not here.
local errors = require "rpchost.errors"
local sized = require "rpchost.sized"

local M = {}
-- the class is a module field, so a RemoteModule travels by RPC (to trainers
-- that share it, as in PyTorch's ddp_rpc) as a table of this class
local RM = {}
M.RemoteModule = RM
RM.__index = RM
RM.__call = function(self, ...) return self:forward(...) end
RM.__tostring = function(self)
  return ("RemoteModule(%s on %s)"):format(self.module_name, self.remote_device)
end

local function rpc() return require "rpchost.rpc" end

-- "worker1" | "worker1/cpu" | "worker1/cuda:0" (or a rank number or WorkerInfo)
local function parse_device(to)
  if type(to) == "string" then
    local name, dev = to:match("^([^/]+)/(.+)$")
    if not name then return to, nil end
    if dev ~= "cpu" and not dev:match("^cuda$") and not dev:match("^cuda:%d+$") then
      error(errors.new("config", ("RemoteModule: bad remote_device %q: the device after '/' must be cpu, cuda " ..
        "or cuda:N (\"worker1/cpu\")"):format(to)), 3)
    end
    return name, dev ~= "cpu" and dev or nil
  elseif type(to) == "number" or (type(to) == "table" and to.name) then
    return to, nil
  end
  error(errors.new("config", ("RemoteModule: expected remote_device as \"worker\" or \"worker/device\", got %s"):format(
    type(to))), 3)
end

-- on the owner: build the module, on the device when one was named
function M._create(cls, args, kwargs, device)
  args = args or {}
  local n = args.n or #args
  local m
  if kwargs ~= nil then
    local a = {unpack(args, 1, n)}
    a[n + 1] = kwargs
    m = cls(unpack(a, 1, n + 1))
  else
    m = cls(unpack(args, 1, n))
  end
  if not sized.is_object(m) or type(m.forward) ~= "function" then -- (a table, or a sized one: nn.Sequential)
    error(("RemoteModule: the constructor gave a %s, not a module with forward"):format(type(m)), 0)
  end
  if device then m:to(device) end
  return m
end

function M._forward(ref, ...)
  return ref:local_value():forward(...)
end

function M._param_rrefs(ref)
  local R = rpc().RRef
  local out = {}
  for i, p in ipairs(ref:local_value():parameters()) do out[i] = R(p) end
  return out
end

function M._train(ref, mode)
  ref:local_value():train(mode)
  return true
end

-- RemoteModule(remote_device, module_cls, args, kwargs)
function M.new(remote_device, cls, args, kwargs)
  local to, device = parse_device(remote_device)
  local callable = type(cls) == "function" or (type(cls) == "table" and getmetatable(cls) and
    getmetatable(cls).__call ~= nil)
  if not callable then
    error(errors.new("config", ("RemoteModule: expected a module class such as nn.Linear (reachable by name on " ..
      "the owner), got %s"):format(type(cls))), 2)
  end
  if args ~= nil and type(args) ~= "table" then
    error(errors.new("config", ("RemoteModule: args must be a list of constructor arguments, got %s"):format(
      type(args))), 2)
  end
  local r = rpc()
  local self = setmetatable({remote_device = tostring(remote_device),
                             module_name = type(cls) == "table" and cls.name or "module"}, RM)
  self.module_rref = r.remote(to, M._create, table.pack(cls, args or {}, kwargs, device))
  -- as PyTorch's, construction waits for the module: a constructor error shows here
  require("rpchost.rpc.rref").wait_created(self.module_rref)
  self.owner = self.module_rref:owner()
  return self
end

function RM:forward(...)
  return rpc().rpc_sync(self.owner, M._forward, table.pack(self.module_rref, ...))
end

function RM:forward_async(...)
  return rpc().rpc_async(self.owner, M._forward, table.pack(self.module_rref, ...))
end

-- the owner's parameters as RRefs (recurse is always true: parameters() is)
function RM:remote_parameters()
  return rpc().rpc_sync(self.owner, M._param_rrefs, {self.module_rref})
end

function RM:get_module_rref() return self.module_rref end

function RM:train(mode)
  rpc().rpc_sync(self.owner, M._train, {self.module_rref, mode ~= false})
  return self
end
function RM:eval() return self:train(false) end

function RM:parameters()
  error(errors.new("config", ("RemoteModule: the parameters live on %s: use remote_parameters() (RRefs, for " ..
    "DistributedOptimizer)"):format(self.remote_device)), 2)
end

return M
