-- rpchost.nn.pipe: nn.Pipe, pipeline parallelism (PyTorch's
-- torch.distributed.pipeline.sync.Pipe, after torchgpipe), extended across
-- workers.
--
-- nn.Pipe(seq, {chunks =, checkpoint =, schedule =, placement =, balance =,
-- deferred_batch_norm =, timeout =}) cuts an nn.Sequential into stages of
-- `balance` layers each, cuts every input batch into `chunks` micro-batches
-- (rpchost.nn.pipe_microbatch) and runs them through the stages in the
-- schedule's order (rpchost.nn.pipe_schedule), each stage working on one
-- micro-batch while the next works on the one before. pipe(x) returns an RRef
-- of the output, as PyTorch's does.
--
-- Where the stages run:
--   * Without placement, or with local devices only ({"cpu", "cuda:0"}), every
--     stage is in this process and shares its modules with seq: the output's
--     graph is the plain model's, so out:backward() (or a distributed
--     backward) trains seq's parameters. One process runs one op at a time, so
--     this is for checkpointing, devices and trying the schedules.
--   * With workers ({"worker1", "worker2/cuda:0", ...}, a rank or a
--     WorkerInfo per stage) each stage is copied to its worker once, when the
--     Pipe is made, and lives there (behind an RRef whose value is the stage's
--     host: its layers and the mailboxes of the runs). A run sends each stage
--     its program, once (M._program): the micro-batches go to the first
--     stage, the targets to the last, and from then on the stages hand each
--     other activations and gradients directly (M._deliver), each running
--     its ops in order as their inputs come (rpchost.nn.pipe_stage); the last
--     stage's reply brings the output (or the losses). Inside a
--     dist_autograd context the activations' RPCs are recorded, so
--     dist_autograd.backward reaches every stage, and pipe:parameter_rrefs()
--     are what DistributedOptimizer needs.
--
-- pipe:train_step(x, target, loss_fn) runs forward and backward together, the
-- pipe driving each micro-batch's backward itself: the 1F1B schedule needs
-- that (a micro-batch's backward starts before later ones' forwards), and
-- GPipe runs the same way. A stage's failure stops the others at once and is
-- raised by the call, naming the stage, its worker and the micro-batch.
local tensor = require "rpchost.tensor"
local autograd = require "rpchost.autograd.engine"
local errors = require "rpchost.errors"
local Future = require "rpchost.future"
local sched = require "rpchost.sched"
local mod = require "rpchost.nn.module"
local layers = require "rpchost.nn.layers"
local mb = require "rpchost.nn.pipe_microbatch"
local schedule = require "rpchost.nn.pipe_schedule"
local stage = require "rpchost.nn.pipe_stage"
local bn = require "rpchost.nn.pipe_batchnorm"

local M = {}

local pack = table.pack or function(...) return {n = select("#", ...), ...} end

-- the rpc layer, loaded when a pipe needs it (an in-process pipe does not)
local function rpc() return require "rpchost.rpc" end
local function dist_autograd() return require "rpchost.rpc.dist_autograd" end
local function rpc_running()
  local a = require("rpchost.rpc.agent").current()
  return a ~= nil and a.state == "running"
end

local function config_error(msg, level)
  error(errors.new("config", "nn.Pipe: " .. msg), (level or 2) + 1)
end

-- options -----------------------------------------------------------------------------------
local OPTIONS = {chunks = true, checkpoint = true, schedule = true, placement = true, balance = true,
                 deferred_batch_norm = true, timeout = true}
local CHECKPOINTS = {always = true, except_last = true, never = true}

local function is_sequential(m)
  if not mod.is_module(m) then return false end
  local cls = getmetatable(m)
  while cls do
    if cls == layers.Sequential then return true end
    cls = rawget(cls, "super")
  end
  return false
end

local function check_options(seq, o)
  if not is_sequential(seq) then
    config_error(("expected an nn.Sequential to cut into stages, got %s"):format(
      mod.is_module(seq) and tostring(getmetatable(seq).name) or type(seq)), 3)
  end
  if o ~= nil and type(o) ~= "table" then
    config_error(("the options must be a table ({chunks = 8, ...}), got %s"):format(type(o)), 3)
  end
  o = o or {}
  for k in pairs(o) do
    if not OPTIONS[k] then
      config_error(("unknown option %s (the options are balance, checkpoint, chunks, deferred_batch_norm, " ..
        "placement, schedule and timeout)"):format(tostring(k)), 3)
    end
  end
  local chunks = o.chunks == nil and 1 or o.chunks
  if type(chunks) ~= "number" or chunks < 1 or chunks % 1 ~= 0 then
    config_error(("chunks must be a positive integer (the number of micro-batches), got %s"):format(
      tostring(chunks)), 3)
  end
  local ck = o.checkpoint == nil and "except_last" or o.checkpoint
  if not CHECKPOINTS[ck] then
    config_error(("checkpoint must be \"always\", \"except_last\" or \"never\", got %s"):format(tostring(ck)), 3)
  end
  local sch = o.schedule == nil and "gpipe" or o.schedule
  if not schedule.SCHEDULES[sch] then
    config_error(("schedule must be \"gpipe\" or \"1f1b\", got %s"):format(tostring(sch)), 3)
  end
  if o.timeout ~= nil and (type(o.timeout) ~= "number" or o.timeout < 0) then
    config_error(("timeout must be a number of seconds (0: none), got %s"):format(tostring(o.timeout)), 3)
  end
  return o, chunks, ck, sch
end

-- the layers of seq, a Sequential's nested in one level (PyTorch's
-- _assemble_partition does the same inside each stage)
local function layers_of(seq)
  local out = seq:children()
  local seen = {}
  for i, l in ipairs(out) do
    if seen[l] then
      config_error(("the Sequential holds the same module twice (layers %d and %d): a stage cannot be cut " ..
        "between them; give each place its own module"):format(seen[l], i), 4)
    end
    seen[l] = i
  end
  return out
end

local function check_balance(balance, n, nplaces)
  if type(balance) ~= "table" or #balance == 0 then
    config_error(("balance must be a list of layer counts, one per stage ({2, 2}), got %s"):format(
      tostring(balance)), 4)
  end
  local sum = 0
  for j, b in ipairs(balance) do
    if type(b) ~= "number" or b < 1 or b % 1 ~= 0 then
      config_error(("balance[%d] is %s: every stage needs a positive whole number of layers"):format(j,
        tostring(b)), 4)
    end
    sum = sum + b
  end
  if sum ~= n then
    config_error(("balance {%s} adds up to %d layers but the Sequential has %d: the counts must add up to " ..
      "its layers"):format(table.concat(balance, ", "), sum, n), 4)
  end
  if nplaces and nplaces ~= #balance then
    config_error(("placement names %d stage%s but balance has %d: give one placement per stage"):format(
      nplaces, nplaces == 1 and "" or "s", #balance), 4)
  end
end

-- layers cut evenly into k stages (the first ones one layer longer)
local function even_balance(n, k)
  if n < k then
    config_error(("placement names %d stages but the Sequential has only %d layers: give at most one stage " ..
      "per layer"):format(k, n), 4)
  end
  local out = {}
  for j = 1, k do out[j] = math.floor(n / k) + (j <= n % k and 1 or 0) end
  return out
end

-- a placement entry: {device =} for this process, {worker =, device =} for a worker
local function parse_place(p, j)
  if type(p) == "string" then
    if p == "cpu" then return {label = p} end
    if p == "cuda" or p:match("^cuda:%d+$") then return {device = p == "cuda" and "cuda:0" or p, label = p} end
    local name, dev = p:match("^([^/]+)/(.+)$")
    if name then
      if dev ~= "cpu" and dev ~= "cuda" and not dev:match("^cuda:%d+$") then
        config_error(("placement[%d] is %q: the device after '/' must be cpu, cuda or cuda:N (\"worker1/cuda:0\")"):
          format(j, p), 4)
      end
      return {worker = name, device = dev ~= "cpu" and (dev == "cuda" and "cuda:0" or dev) or nil, label = p}
    end
    return {worker = p, label = p}
  elseif type(p) == "number" or (type(p) == "table" and p.name and p.id) then
    return {worker = p, label = tostring(type(p) == "table" and p.name or p)}
  end
  config_error(("placement[%d] is a %s: give a worker name (\"worker1\", \"worker1/cuda:0\"), a rank, a " ..
    "WorkerInfo or a device of this process (\"cpu\", \"cuda:0\")"):format(j, type(p)), 4)
end

-- LocalRRef -------------------------------------------------------------------------------
-- What pipe(x) returns in a process without RPC: an RRef's methods over a value
-- of this process (with RPC running, pipe(x) gives a real rpc.RRef).
local LocalRRef = {}
LocalRRef.__index = LocalRRef
LocalRRef.__tostring = function() return "LocalRRef(nn.Pipe output)" end
M.LocalRRef = LocalRRef
function LocalRRef:to_here() return self.value end
function LocalRRef:local_value() return self.value end
function LocalRRef:is_owner() return true end
function LocalRRef:confirmed_by_owner() return true end
local function no_rpc(what)
  error(errors.new("shutdown", ("%s: RPC is not initialised in this process, so this RRef has no owner " ..
    "name (call rpc.init_rpc before making the Pipe's output, or use local_value)"):format(what)), 3)
end
function LocalRRef:owner() no_rpc("owner") end
function LocalRRef:owner_name() no_rpc("owner_name") end
function LocalRRef:backward(ctx_id, retain_graph)
  if ctx_id then dist_autograd().backward(ctx_id, {self.value}, retain_graph)
  else self.value:backward(nil, retain_graph) end
end

local function rref_of(v)
  if rpc_running() then return rpc().RRef(v) end
  return setmetatable({value = v}, LocalRRef)
end

-- stage hosts (on the workers that hold stages) ------------------------------------------------
-- hosts["<pipe id>/<j>"]: the host of stage j of a pipe, the value of the RRef
-- the driver keeps (weak: it goes when that RRef does).
local hosts = setmetatable({}, {__mode = "v"})

-- on the stage's worker: the host of stage j of S, made of the layers sent
function M._host(id, j, S, partition, device, deferred)
  local ls = partition:children()
  if device then
    for _, l in ipairs(ls) do l:to(device) end
  end
  local host = {id = id, j = j, S = S, layers = ls, device = device, deferred = deferred, boxes = {}, done = 0,
                aborted = {}}
  hosts[id .. "/" .. j] = host
  return host
end

function M._param_rrefs(host_rref)
  local R = rpc().RRef
  local out = {}
  for _, l in ipairs(host_rref:local_value().layers) do
    for _, p in ipairs(l:parameters()) do out[#out + 1] = R(p) end
  end
  return out
end

-- the stage's state_dict, named as in an in-process Pipe's ("<layer>.<name>"
-- here; the driver adds "partitions.<stage>.")
function M._state_dict(host_rref)
  local out = {}
  for i, l in ipairs(host_rref:local_value().layers) do
    for k, v in pairs(l:state_dict()) do out[(i - 1) .. "." .. k] = v end
  end
  return out
end

-- a run's mailbox at a host: activations ("act") and gradients ("grad") by micro-batch
local function box_of(host, step)
  local b = host.boxes[step]
  if not b then
    b = {act = {}, grad = {}}
    host.boxes[step] = b
  end
  return b
end

local function slot(b, kind, i)
  local f = b[kind][i]
  if not f then
    f = Future.new("nn.Pipe " .. kind)
    b[kind][i] = f
  end
  return f
end

-- a stage's run that ended (or was stopped): its mailboxes go, and whatever
-- still comes for it is dropped
local function close_run(host, step)
  if step > host.done then host.done = step end
  for s in pairs(host.boxes) do if s <= host.done then host.boxes[s] = nil end end
  for s in pairs(host.aborted) do if s <= host.done then host.aborted[s] = nil end end
end

-- the message of a stage stopped because another failed (a driver prefers the other's error)
local STOPPED = "nn.Pipe: stopped: "

-- from another stage: micro-batch i's activation or gradient for stage j
function M._deliver(id, j, step, kind, i, value)
  local host = hosts[id .. "/" .. j]
  if not host then
    error(("nn.Pipe: stage %d of pipe %s is not on this worker (the Pipe was collected?)"):format(j, id), 0)
  end
  if step <= host.done then return false end
  local f = slot(box_of(host, step), kind, i)
  if not f:done() then f:_set_result(value) end
  return true
end

-- (it only notes what came: it runs at once when it arrives, in the loop,
-- not queued behind this worker's tasks, so the stage waiting for it starts
-- as soon as its computing lets it)
require("rpchost.rpc.callee").mark_inline(M._deliver)

-- from a stage that failed (or the driver): stop every stage of this run here
function M._abort(id, step, message)
  local prefix = id .. "/"
  for key, host in pairs(hosts) do
    if key:sub(1, #prefix) == prefix and step > host.done then
      host.aborted[step] = message
      local b = host.boxes[step]
      if b then
        for _, kind in ipairs{"act", "grad"} do
          for _, f in pairs(b[kind]) do
            if not f:done() then f:_set_error(errors.new("remote", STOPPED .. message)) end
          end
        end
      end
    end
  end
  return true
end

-- waits for micro-batch i's activation or gradient
local function await(host, step, kind, i, plan)
  if host.aborted[step] then error(errors.new("remote", STOPPED .. host.aborted[step]), 0) end
  local f = slot(box_of(host, step), kind, i)
  local timeout = plan.timeout
  if timeout == nil then timeout = rpc().get_rpc_timeout() end
  local ok, v = pcall(f.wait, f, timeout)
  if ok then
    box_of(host, step)[kind][i] = nil
    return v
  end
  if errors.is(v) and v.kind == "timeout" then
    local from = kind == "act" and host.j - 1 or host.j + 1
    error(errors.new("timeout", ("nn.Pipe: stage %d waited %g s for the %s of micro-batch %d from stage %d (%s)"):
      format(host.j, timeout, kind == "act" and "activation" or "gradient", i, from,
      tostring(kind == "act" and plan.prev or plan.next))), 0)
  end
  error(v, 0)
end

-- stage j's part of a run, on its worker (see rpchost.nn.pipe_stage)
local function program(host, step, plan)
  local r = rpc()
  local j, S = host.j, host.S
  for _, l in ipairs(host.layers) do l:train(plan.training) end
  local run = {mode = plan.mode, m = plan.m, checkpoint_stop = plan.checkpoint_stop, training = plan.training,
               device = host.device, deferred = host.deferred, pipe = host.id, step = step,
               loss_fn = plan.loss_fn, targets = plan.targets, weights = plan.weights}
  if plan.mode == "train" then run.sink = dist_autograd()._context_sink(plan.ctx) end
  local st = stage.new(host.layers, j, S, run)
  local sends, outs = {}, {}
  local where = "before its first micro-batch"
  local ok, err = pcall(function()
    for _, op in ipairs(schedule.ops(plan.schedule, plan.mode, S, j, plan.m)) do
      if op > 0 then
        where = ("in the forward of micro-batch %d"):format(op)
        local x
        if j == 1 then
          x = plan.inputs[op]
          plan.inputs[op] = nil
        else
          x = await(host, step, "act", op, plan)
        end
        local y = st:forward(op, x)
        if j < S then
          sends[#sends + 1] = r.rpc_async(plan.next, M._deliver, {host.id, j + 1, step, "act", op, y}, nil,
            plan.timeout)
        elseif plan.mode == "forward" then
          outs[op] = y
        end
      else
        local i = -op
        where = ("in the backward of micro-batch %d"):format(i)
        local gy = j < S and await(host, step, "grad", i, plan) or nil
        local gx = st:backward(i, gy)
        if j > 1 then
          sends[#sends + 1] = r.rpc_async(plan.prev, M._deliver, {host.id, j - 1, step, "grad", i, gx}, nil,
            plan.timeout)
        end
      end
    end
    where = "handing on its last results"
    r.wait_all(sends)
  end)
  close_run(host, step)
  if not ok then
    local msg = errors.is(err) and err.message or tostring(err)
    if type(msg) == "string" and msg:sub(1, #STOPPED) == STOPPED then error(err, 0) end
    msg = ("nn.Pipe: stage %d of %d (on %s) failed %s: %s"):format(j, S, r.get_worker_info().name, where,
      tostring(msg))
    -- every other stage stops now rather than wait for what will not come
    for _, peer in ipairs(plan.peers) do
      r.rpc_async(peer, M._abort, {host.id, step, msg}):add_done_callback(function() end)
    end
    error(errors.new(errors.is(err) and err.kind or "remote", msg), 0)
  end
  if j == S then
    if plan.mode == "forward" then return mb.gather(outs) end
    return st.losses
  end
  return true
end

-- The request: answered when the program ends, which runs in a task of its
-- own (it waits on other stages: it must not hold one of this worker's
-- handler slots while it does), in the caller's autograd context.
function M._program(host_rref, step, plan)
  local fut = Future.new("nn.Pipe stage program")
  local ctx = dist_autograd().current()
  local host = host_rref:local_value()
  sched.spawn(function()
    sched.current().ag_ctx = ctx
    plan.ctx = ctx
    local res = pack(pcall(autograd.set_grad_enabled, plan.grad, program, host, step, plan))
    if res[1] then fut:_set_result(res[2])
    else fut:_set_error(require("rpchost.rpc.agent").current():remote_error(res[2])) end
  end, {name = "nn.Pipe stage " .. host.j})
  return fut
end

require("rpchost.rpc.callee").mark_async(M._program)

-- the Pipe ------------------------------------------------------------------------------------
local Pipe = mod.Module:extend("Pipe")
M.Pipe = Pipe

local counter = 0

function Pipe:__init(seq, opts)
  local o, chunks, ck, sch = check_options(seq, opts)
  local ls = layers_of(seq)
  local places
  if o.placement ~= nil then
    if type(o.placement) ~= "table" or #o.placement == 0 then
      config_error(("placement must be a list with one worker name or device per stage, got %s"):format(
        tostring(o.placement)), 2)
    end
    places = {}
    for j, p in ipairs(o.placement) do places[j] = parse_place(p, j) end
  end
  local balance = o.balance
  if balance ~= nil then check_balance(balance, #ls, places and #places)
  elseif places then balance = even_balance(#ls, #places)
  else balance = {#ls} end
  if #ls == 0 then balance = {} end
  self.chunks, self.checkpoint, self.schedule, self.timeout = chunks, ck, sch, o.timeout
  self.balance = balance
  if o.deferred_batch_norm then
    for k, l in ipairs(ls) do
      local c = bn.convert(l, chunks)
      if c ~= l then
        seq._modules[seq._mnames[k]] = c
        ls[k] = c
      end
    end
  end
  self.deferred = o.deferred_batch_norm and true or false
  self._step = 0
  -- the stages' layers, nested Sequentials opened one level (PyTorch's _assemble_partition)
  local parts, k = {}, 0
  for j, n in ipairs(balance) do
    local part = {}
    for _ = 1, n do
      k = k + 1
      if is_sequential(ls[k]) then
        for _, c in ipairs(ls[k]:children()) do part[#part + 1] = c end
      else
        part[#part + 1] = ls[k]
      end
    end
    parts[j] = part
  end
  local remote = false
  for _, p in ipairs(places or {}) do remote = remote or p.worker ~= nil end
  if remote then self:_place_remote(parts, places) else self:_place_local(parts, places) end
end

-- every stage in this process, on its device when placement names one
function Pipe:_place_local(parts, places)
  counter = counter + 1
  self._id = "local:" .. counter
  local seqs = {}
  for j, part in ipairs(parts) do
    seqs[j] = layers.Sequential(unpack(part))
    local dev = places and places[j].device
    if dev then seqs[j]:to(dev) end
  end
  self.partitions = layers.ModuleList(seqs)
  self._layers = parts
  self.devices = {}
  for j = 1, #parts do self.devices[j] = places and places[j].device or "cpu" end
end

-- a parameter in stages on two workers would become two copies that train apart
local function check_shared(parts, owners)
  local first = {}
  for j, part in ipairs(parts) do
    for _, l in ipairs(part) do
      for _, p in ipairs(l:parameters()) do
        local i = first[p]
        if i and owners[i] ~= owners[j] then
          config_error(("a parameter is shared by layers of stages %d and %d, which live on different workers " ..
            "(%s and %s): each would train its own copy; keep layers that share parameters in one stage"):format(
            i, j, tostring(owners[i]), tostring(owners[j])), 4)
        end
        first[p] = first[p] or j
      end
    end
  end
end

-- each stage on its worker: its layers are copied there once, now
function Pipe:_place_remote(parts, places)
  if not rpc_running() then
    config_error(("placement names workers (%s): call rpc.init_rpc before making the Pipe"):format(
      places[1].worker and places[1].label or "..."), 3)
  end
  local r = rpc()
  local me = r.get_worker_info()
  counter = counter + 1
  self._id = me.name .. ":" .. counter
  local owners = {}
  for j, p in ipairs(places) do
    local ok, info = pcall(r.get_worker_info, p.worker or me.name)
    if not ok then
      config_error(("placement[%d]: %s"):format(j, errors.is(info) and info.message or tostring(info)), 3)
    end
    owners[j] = info.name
  end
  check_shared(parts, owners)
  self._stages = {}
  for j, part in ipairs(parts) do
    local host = r.remote(owners[j], M._host, {self._id, j, #parts, layers.Sequential(unpack(part)),
      places[j].device, self.deferred})
    self._stages[j] = {owner = owners[j], rref = host, device = places[j].device}
  end
  -- as RemoteModule's: a stage that cannot be made there is an error now
  local rref = require "rpchost.rpc.rref"
  for _, s in ipairs(self._stages) do rref.wait_created(s.rref) end
  self.placement = owners
end

-- the last run's pipe id and number: its trace events carry them (args.pipe,
-- args.step), so a program can find one run's events in its trace
function Pipe:last_run() return self._id, self._step end

function Pipe:len()
  local n = 0
  for _, b in ipairs(self.balance) do n = n + b end
  return n
end

function Pipe:is_remote() return self._stages ~= nil end

function Pipe:parameters(out)
  if self._stages then
    config_error(("the parameters live on the stages' workers (%s): use parameter_rrefs() (RRefs, for " ..
      "DistributedOptimizer)"):format(table.concat(self.placement, ", ")), 2)
  end
  return mod.Module.parameters(self, out)
end

-- parameter_rrefs() -> RRefs of every parameter, in seq:parameters() order
function Pipe:parameter_rrefs()
  local r = rpc()
  if not self._stages then
    local out = {}
    for i, p in ipairs(self:parameters()) do out[i] = r.RRef(p) end
    return out
  end
  local futs = {}
  for j, s in ipairs(self._stages) do futs[j] = r.rpc_async(s.owner, M._param_rrefs, {s.rref}) end
  local out = {}
  for _, list in ipairs(r.wait_all(futs)) do
    for _, p in ipairs(list) do out[#out + 1] = p end
  end
  return out
end

-- state_dict(): PyTorch's Pipe's names ("partitions.<stage>.<layer>.<name>",
-- 0-based); across workers, the stages' current values fetched from them
function Pipe:state_dict(opts)
  if not self._stages then return mod.Module.state_dict(self, opts) end
  local r = rpc()
  local futs = {}
  for j, s in ipairs(self._stages) do futs[j] = r.rpc_async(s.owner, M._state_dict, {s.rref}) end
  local out = {}
  for j, sd in ipairs(r.wait_all(futs)) do
    for k, v in pairs(sd) do out[("partitions.%d.%s"):format(j - 1, k)] = v end
  end
  return out
end

function Pipe:load_state_dict(sd, opts)
  if self._stages then
    config_error("load_state_dict: the stages were copied to their workers when the Pipe was made: load the " ..
      "weights into the Sequential before making the Pipe", 2)
  end
  return mod.Module.load_state_dict(self, sd, opts)
end

function Pipe:to(spec, opts)
  if not tensor.is_dtype(spec) then
    config_error("the Pipe places its stages itself: move the layers before making it, or give each stage a " ..
      "device in placement ({\"cpu\", \"cuda:0\"})", 2)
  end
  if self._stages then
    config_error("the stages were copied to their workers when the Pipe was made: convert the layers before " ..
      "making it", 2)
  end
  return mod.Module.to(self, spec, opts)
end
function Pipe:cuda() return self:to("cuda") end

-- which micro-batches run checkpointed: those below the stop
function Pipe:_checkpoint_stop(m)
  if not self.training then return 0 end
  if self.checkpoint == "always" then return m end
  if self.checkpoint == "except_last" then return m - 1 end
  return 0
end

-- runs the stages of this process: each stage's ops in order, as their inputs
-- come; every sweep runs at most one op per stage, downstream first (so a
-- forward sweep is one of GPipe's clock cycles)
function Pipe:_run_local(mode, batches, extra)
  local S, m = #self._layers, #batches
  self._step = self._step + 1
  local ctx = dist_autograd().current()
  local stages, ops, pc, acts, grads = {}, {}, {}, {}, {}
  for j = 1, S do
    local run = {mode = mode, m = m, checkpoint_stop = self:_checkpoint_stop(m), training = self.training,
                 device = self.devices[j] ~= "cpu" and self.devices[j] or nil, deferred = self.deferred,
                 pipe = self._id, step = self._step}
    if mode == "train" then
      run.sink = ctx and dist_autograd()._context_sink(ctx) or nil
      if j == S then run.loss_fn, run.targets, run.weights = extra.loss_fn, extra.targets, extra.weights end
    end
    stages[j] = stage.new(self._layers[j], j, S, run)
    ops[j] = schedule.ops(self.schedule, mode, S, j, m)
    pc[j], acts[j], grads[j] = 1, {}, {}
  end
  for i, b in ipairs(batches) do acts[1][i] = b end
  local outs, left = {}, 0
  for j = 1, S do left = left + #ops[j] end
  while left > 0 do
    local ran = false
    for j = S, 1, -1 do
      local op = ops[j][pc[j]]
      if op and op > 0 and acts[j][op] ~= nil then
        local x = acts[j][op]
        acts[j][op] = nil
        local y = stages[j]:forward(op, x)
        if j < S then acts[j + 1][op] = y else outs[op] = y end
        pc[j], left, ran = pc[j] + 1, left - 1, true
      elseif op and op < 0 and (j == S or grads[j][-op] ~= nil) then
        local g = grads[j][-op]
        grads[j][-op] = nil
        local gx = stages[j]:backward(-op, g)
        if j > 1 then grads[j - 1][-op] = gx end
        pc[j], left, ran = pc[j] + 1, left - 1, true
      end
    end
    assert(ran, "nn.Pipe: the schedule is stuck (a bug in rpchost.nn.pipe_schedule)")
  end
  if mode == "forward" then return mb.gather(outs) end
  return stages[S].losses
end

-- one run on the workers: each stage's program, then the wait for all
function Pipe:_run_remote(mode, batches, extra)
  local r = rpc()
  -- runs of one pipe take turns (a stage's mailboxes are per run, in order)
  while self._busy do self._busy:wait() end
  local busy = Future.new("nn.Pipe run")
  self._busy = busy
  self._step = self._step + 1
  local step, S, m = self._step, #self._stages, #batches
  local peers, seen = {}, {}
  for _, s in ipairs(self._stages) do
    if not seen[s.owner] then seen[s.owner] = true; peers[#peers + 1] = s.owner end
  end
  local futs, out = {}, nil
  local ok, err = pcall(function()
    for j, s in ipairs(self._stages) do
      local plan = {mode = mode, schedule = self.schedule, m = m, checkpoint_stop = self:_checkpoint_stop(m),
                    training = self.training, grad = autograd.enabled(), timeout = self.timeout, peers = peers,
                    prev = j > 1 and self._stages[j - 1].owner or nil,
                    next = j < S and self._stages[j + 1].owner or nil}
      if j == 1 then plan.inputs = batches end
      if j == S and mode == "train" then
        plan.loss_fn, plan.targets, plan.weights = extra.loss_fn, extra.targets, extra.weights
      end
      -- (no limit on a program as a whole, which runs as long as its stage's
      -- work: each of its waits for a neighbour is bounded, a failure stops
      -- every stage, and a worker gone silent is unreachable)
      futs[j] = r.rpc_async(s.owner, M._program, {s.rref, step, plan}, nil, 0)
    end
    -- (the last stage's reply carries the output, or the losses: the first
    -- stage's error, wherever it is, ends the wait)
    out = r.wait_all(futs)[S]
  end)
  self._busy = nil
  busy:_set_result(true)
  if not ok then error(self:_failed(err, step, futs), 0) end
  return out
end

-- a run failed: every stage stops; the error raised is the first stage's own
-- (not one stopped because of it), if it comes within a moment
local GRACE = 2
function Pipe:_failed(err, step, futs)
  local r = rpc()
  local msg = errors.is(err) and err.message or tostring(err)
  for _, peer in ipairs(self.placement) do
    pcall(function() r.rpc_async(peer, M._abort, {self._id, step, tostring(msg)}):add_done_callback(function() end) end)
  end
  local function stopped(e)
    local m = errors.is(e) and e.message or tostring(e)
    return type(m) == "string" and m:find(STOPPED, 1, true) ~= nil
  end
  if not stopped(err) then return err end
  local deadline = sched.now() + GRACE
  for _, f in ipairs(futs) do
    local ok, e = pcall(f.wait, f, math.max(0.001, deadline - sched.now()))
    if not ok and f:done() and not stopped(e) then return e end
  end
  return err
end

function Pipe:_run(mode, batches, extra)
  if self._stages then return self:_run_remote(mode, batches, extra) end
  return self:_run_local(mode, batches, extra)
end

-- pipe(x, ...) / pipe:forward(x, ...) -> RRef of the output
function Pipe:forward(...)
  local inputs = pack(...)
  if #self.balance == 0 then return rref_of(inputs.n == 1 and inputs[1] or inputs) end
  local batches = mb.scatter(inputs, self.chunks)
  return rref_of(self:_run("forward", batches))
end

local function callable(f)
  if type(f) == "function" then return true end
  local mt = (type(f) == "table" or type(f) == "userdata") and getmetatable(f)
  return mt and mt.__call ~= nil
end

-- train_step(input, target, loss_fn, {loss_reduction = "mean"}) -> the
-- mini-batch's loss, and the micro-batches' (weighted) losses. input, target:
-- a tensor, or a list of values (several inputs). Each micro-batch's loss is
-- loss_fn(output, target) weighted by its share of the rows ("mean", for a
-- loss that averages over them) or not ("sum"), so the gradients are the
-- whole mini-batch's. Parameters' gradients add up in .grad, or, inside a
-- dist_autograd context, in the context (DistributedOptimizer's step reads
-- them there); across workers a context is required.
function Pipe:train_step(input, target, loss_fn, o)
  o = o or {}
  if not callable(loss_fn) then
    config_error(("train_step(input, target, loss_fn): loss_fn must be a function or a loss module, got %s"):format(
      type(loss_fn)), 2)
  end
  local red = o.loss_reduction or "mean"
  if red ~= "mean" and red ~= "sum" then
    config_error(("train_step: loss_reduction must be \"mean\" or \"sum\", got %s"):format(tostring(red)), 2)
  end
  if #self.balance == 0 then config_error("train_step: the Pipe has no layers", 2) end
  if self._stages and not dist_autograd().current() then
    config_error("train_step: the stages live on other workers, whose gradients go to a distributed autograd " ..
      "context: call it inside dist_autograd.context(function(ctx) ... end) and step a DistributedOptimizer " ..
      "over pipe:parameter_rrefs() with ctx", 2)
  end
  local batches = mb.scatter(mb.is_tuple(input) and pack(mb.args(input)) or pack(input), self.chunks,
    "nn.Pipe:train_step (input)")
  local targets = mb.scatter(mb.is_tuple(target) and pack(mb.args(target)) or pack(target), self.chunks,
    "nn.Pipe:train_step (target)")
  if #targets ~= #batches then
    config_error(("train_step: the input cuts into %d micro-batches but the target into %d: give them the same " ..
      "number of rows"):format(#batches, #targets), 2)
  end
  local total, weights = 0, {}
  for i, b in ipairs(batches) do
    weights[i] = mb.rows(b)
    total = total + weights[i]
  end
  for i = 1, #weights do weights[i] = red == "mean" and weights[i] / total or 1 end
  local losses = autograd.enable_grad(function()
    return self:_run("train", batches, {loss_fn = loss_fn, targets = targets, weights = weights})
  end)
  local sum = 0
  for _, l in ipairs(losses) do sum = sum + l end
  return sum, losses
end

function Pipe:extra_repr()
  return ("balance={%s}, chunks=%d, checkpoint=%s, schedule=%s%s"):format(table.concat(self.balance, ", "),
    self.chunks, self.checkpoint, self.schedule,
    self.placement and (", placement={" .. table.concat(self.placement, ", ") .. "}") or "")
end

return M
