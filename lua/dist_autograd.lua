-- dist_autograd: distributed autograd (PyTorch's FAST mode, in spirit).
--
-- Inside a context, an RPC that carries a tensor requiring gradients records a
-- "send" on the sender (the tensor, under a send id) and a "recv" node on the
-- receiver (a graph node whose backward sends the gradient back). backward(ctx,
-- roots) runs local autograd from the roots; reaching a recv node makes an RPC
-- to the sender, which runs its own local backward from the recorded tensor, and
-- so on across workers. Leaf gradients go to the context (get_gradients), never
-- into .grad. A context exists on every worker it reaches under the same id.
local sched = require "rpchost.sched"
local codec = require "rpchost.codec"
local errors = require "rpchost.errors"
local autograd = require "rpchost.autograd"
local core = require "rpchost.core"
require "tensor"

local M = {}

local contexts = {}
local counter = 0

local function rpc() return require "rpc" end

local function my_rank()
  local a = rpc()._agent()
  if not a then
    error(errors.new("shutdown", "dist_autograd needs RPC: call rpc.init_rpc first"), 0)
  end
  return a.rank
end

local function get(id, create)
  local c = contexts[id]
  if not c and create then
    c = {id = id, sends = {}, nsend = 0, grads = {}, peers = {}}
    contexts[id] = c
  end
  return c
end

local function need(id, what)
  local c = contexts[id]
  if not c then
    error(errors.new("config", ("%s: no distributed autograd context %s on this worker (use " ..
      "dist_autograd.context or begin)"):format(what, tostring(id))), 0)
  end
  return c
end

-- begin() -> context id (unique across workers); finish(id) releases it here and
-- on the workers it reached.
function M.begin()
  counter = counter + 1
  local id = my_rank() * 2 ^ 32 + counter
  get(id, true)
  local t = sched.current()
  if t then t.ag_ctx = id end
  return id
end

function M._release(id)
  contexts[id] = nil
  return true
end

function M.finish(id)
  local c = contexts[id]
  if not c then return end
  contexts[id] = nil
  local t = sched.current()
  if t and t.ag_ctx == id then t.ag_ctx = nil end
  local a = rpc()._agent()
  for rank in pairs(c.peers) do
    if a and a.state == "running" and rank ~= a.rank then
      local ok, f = pcall(a.call, a, rank, M._release, {id}, nil, 0)
      if ok then f:add_done_callback(function() end) end
    end
  end
end

-- context(fn): fn(ctx_id) runs inside a fresh context, released afterwards
function M.context(fn)
  local t = sched.current()
  local outer = t and t.ag_ctx
  local id = M.begin()
  local r = table.pack(pcall(fn, id))
  if t then t.ag_ctx = outer end
  M.finish(id)
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

function M.current() local t = sched.current() return t and t.ag_ctx end

-- wire hooks ---------------------------------------------------------------------------
-- outgoing tensor that requires gradients: remember it under a send id
codec.ag_register = function(id, t)
  if not autograd.requires(t) then return nil end
  local c = get(id, true)
  c.nsend = c.nsend + 1
  c.sends[c.nsend] = t
  local dest = codec.dest_rank
  if dest then c.peers[dest] = true end
  return c.nsend
end

-- incoming: the tensor becomes the output of a recv node
codec.ag_attach = function(id, src, send, t)
  local c = get(id, true)
  c.peers[src] = true
  autograd.meta[t] = {requires_grad = true, grad_fn = setmetatable({
    name = "recv", inputs = {n = 0},
    backward = function(g)
      local a = rpc()._agent()
      -- a CUDA gradient goes back as a host tensor: this worker may have no device
      -- map towards `src` (only the forward direction needs one), and the sender
      -- puts it on its own tensor's device (_propagate). CUDA tensors travel as
      -- host bytes anyway, so this costs no extra transfer.
      if core.t_device(g) >= 0 then g = core.t_to_device(g, -1) end
      a:call(src, M._propagate, {id, send, g}, nil, 0):wait()
    end,
  }, autograd.Node)}
  return t
end

local function sink_into(c)
  return function(t, g)
    local prev = c.grads[t]
    c.grads[t] = prev and core.t_binary(0, prev, g) or core.t_clone(g)
  end
end

-- a gradient for send `send` of context `id` arrived: backward from that tensor
function M._propagate(id, send, g)
  local c = get(id, true) -- a worker may start a backward in a context it has not seen yet (RRef:backward)
  local t = c.sends[send]
  if not t then error(("unknown send %s in context %s"):format(tostring(send), tostring(id)), 0) end
  -- the gradient of a tensor lives on that tensor's device
  if core.t_is_tensor(g) and core.t_device(g) ~= core.t_device(t) then g = core.t_to_device(g, core.t_device(t)) end
  local task = sched.current()
  local outer = task.ag_ctx
  task.ag_ctx = id
  local ok, err = pcall(autograd.backward, t, g, true, sink_into(c))
  task.ag_ctx = outer
  if not ok then error(err, 0) end
  return true
end

-- backward(ctx_id, {roots}, [retain_graph])
function M.backward(id, roots, retain_graph)
  if type(id) ~= "number" then
    error(errors.new("config", "backward: expected a context id (from dist_autograd.context or begin)"), 2)
  end
  local c = get(id, true) -- a worker may start a backward in a context it has not seen yet (RRef:backward)
  if c.graph_freed then
    error(errors.new("config", ("backward: context %s already ran a backward without retain_graph, so its " ..
      "graph is gone; pass retain_graph = true to the first backward to run it again"):format(tostring(id))), 2)
  end
  if type(roots) ~= "table" then roots = {roots} end
  local task = sched.current()
  local outer = task and task.ag_ctx
  if task then task.ag_ctx = id end
  local ok, err = pcall(function()
    for _, r in ipairs(roots) do
      -- graphs may be entered again through other workers: keep them for the context
      autograd.backward(r, nil, true, sink_into(c))
    end
  end)
  if task then task.ag_ctx = outer end
  if not ok then error(err, 0) end
  -- (the graph itself is kept for the context: other workers may enter it again)
  if not retain_graph then c.graph_freed = true end
end

-- get_gradients(ctx_id) -> {[tensor] = gradient} for the tensors on this worker
function M.get_gradients(id)
  local c = need(id, "get_gradients")
  local out = {}
  for t, g in pairs(c.grads) do out[t] = g end
  return out
end

function M._grads(id)
  local c = contexts[id]
  return c and c.grads or {}
end

return M
