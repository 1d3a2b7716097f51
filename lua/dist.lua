-- dist: the process group (torch.distributed) for Lua (see API.md).
-- Membership and rendezvous go through the same store as rpc: init_process_group
-- and init_rpc pointed at one address share one store connection.
local errors = require "rpchost.errors"
local env = require "rpchost.env"
local store = require "rpchost.store"
local log = require "rpchost.log"

local dist = {}

local group = nil -- {rank, world_size, backend, host, port, store, key, prefix}

dist.ReduceOp = {SUM = "SUM", PRODUCT = "PRODUCT", MIN = "MIN", MAX = "MAX", AVG = "AVG"}

local BACKENDS = {gloo = "gloo", tcp = "gloo", nccl = "nccl"}

local function cfg(msg, ...) error(errors.new("config", msg:format(...)), 0) end

-- init_process_group{backend=, init_method=, rank=, world_size=, timeout=}
function dist.init_process_group(o, ...)
  if type(o) == "string" then o = {backend = o, init_method = (select(1, ...))} end
  o = o or {}
  if group then cfg("init_process_group: the default process group is already initialised") end
  local backend = BACKENDS[o.backend or "gloo"]
  if not backend then
    cfg("init_process_group: unknown backend '%s' (use \"gloo\", \"tcp\" or \"nccl\")", tostring(o.backend))
  end
  local rank = o.rank
  if rank == nil then rank = env.rank() end
  local world_size = o.world_size
  if world_size == nil then world_size = env.world_size() end
  if type(rank) ~= "number" or rank < 0 or rank ~= math.floor(rank) then
    cfg("init_process_group: rank must be an integer >= 0 (pass rank= or set RANK), got %s", tostring(rank))
  end
  if type(world_size) ~= "number" or world_size < 1 or world_size ~= math.floor(world_size) then
    cfg("init_process_group: world_size must be an integer >= 1 (pass world_size= or set WORLD_SIZE), got %s",
      tostring(world_size))
  end
  if rank >= world_size then
    cfg("init_process_group: rank %d is out of range for world_size %d (ranks are 0..%d)", rank,
      world_size, world_size - 1)
  end
  local host, port = env.master(o.init_method)
  local timeout = env.init_timeout(o.timeout)
  local host_it = rank == 0 and not store.hosted_by_launcher(host, port)
  local client, key = store.acquire(host, port, host_it, timeout)
  local ok, err = pcall(function()
    local gen = client:add("pg/gen/" .. rank, 1)
    local P = ("pg/%d/"):format(gen)
    local same, ows, orank = client:agree(P .. "world_size", world_size, rank)
    if not same then
      local msg = ("process group world_size mismatch: rank %d was started with world_size %d, " ..
        "rank %s with world_size %s"):format(rank, world_size, tostring(orank), tostring(ows))
      client:set(P .. "abort", msg)
      cfg("%s", msg)
    end
    client:set(P .. "rank/" .. rank, "1")
    local keys = {}
    for r = 0, world_size - 1 do keys[#keys + 1] = P .. "rank/" .. r end
    client:wait_verbose(keys, timeout, P .. "abort", function(miss)
      local ranks = {}
      for _, k in ipairs(miss) do ranks[#ranks + 1] = k:match("(%d+)$") end
      return ("process group rank%s %s to join"):format(#ranks > 1 and "s" or "", table.concat(ranks, ", "))
    end)
    group = {rank = rank, world_size = world_size, backend = backend, host = host, port = port,
             store = client, key = key, prefix = P, timeout = timeout}
  end)
  if not ok then
    store.release(key)
    error(err, 0)
  end
  log.debug("process group ready: rank %d of %d (%s)", rank, world_size, backend)
end

function dist.destroy_process_group()
  if not group then
    cfg("destroy_process_group: this rank is not in an initialised process group " ..
        "(init_process_group was not called here, or the group was already destroyed)")
  end
  local g = group
  group = nil
  store.release(g.key)
end

function dist.is_initialized() return group ~= nil end

local function need(what)
  if not group then
    cfg("%s: the default process group is not initialised (call dist.init_process_group first)", what)
  end
  return group
end

function dist.get_rank() return need("get_rank").rank end
function dist.get_world_size() return need("get_world_size").world_size end
function dist.get_backend() return need("get_backend").backend end

-- host, port of the group's store (rpc checks that it meets at the same place)
function dist._store_address()
  local g = need("_store_address")
  return g.host, g.port
end

function dist._group() return group end

return dist
