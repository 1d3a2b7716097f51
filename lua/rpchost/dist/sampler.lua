-- rpchost.dist.sampler: DistributedSampler, this rank's share of a dataset's
-- indices, as torch.utils.data.distributed.DistributedSampler draws them.
local errors = require "rpchost.errors"
local env = require "rpchost.env"
local sized = require "rpchost.sized"

local M = {}

local function cfg(msg, ...) error(errors.new("config", msg:format(...)), 0) end

-- DistributedSampler(n, {rank=, world_size=, shuffle=true, seed=0, drop_last=false}):
-- this rank's share of 1..n, disjoint from the others', reshuffled per epoch with
-- set_epoch. Iterate with `for i in sampler:iter()` or use sampler:indices();
-- `#sampler` (or sampler:len()) is this rank's count. A sampler is a sized
-- object (rpchost.sized: a userdata proxy, so that `#` counts it).
local Sampler = {name = "DistributedSampler", __sized = true}
Sampler.__index = Sampler

function M.new(n, o, pg_rank, pg_world)
  o = o or {}
  errors.check_options(o, {"rank", "world_size", "num_replicas", "shuffle", "seed", "drop_last"}, "DistributedSampler")
  local rank = o.rank or pg_rank or env.rank() or 0
  local world = o.world_size or o.num_replicas or pg_world or env.world_size() or 1
  if type(n) ~= "number" or n < 0 then cfg("DistributedSampler: n must be a count of samples") end
  if rank < 0 or rank >= world then cfg("DistributedSampler: rank %d is out of range for world_size %d", rank, world) end
  local s = setmetatable({n = n, rank = rank, world = world, shuffle = o.shuffle ~= false, seed = o.seed or 0,
                          drop_last = o.drop_last, epoch = 0}, Sampler)
  if s.drop_last then s.num_samples = math.floor(n / world)
  else s.num_samples = math.ceil(n / world) end
  return sized.new(s)
end

function Sampler:set_epoch(e) self.epoch = e end
function Sampler:len() return self.num_samples end

function Sampler:indices()
  local idx
  if self.shuffle then
    -- torch's draw, so that code ported from PyTorch sees its data order: a
    -- generator seeded with seed + epoch (the same on every rank) and randperm
    -- (1-based here: torch's permutation + 1)
    local tensor = require "rpchost.tensor"
    local g = tensor.Generator():manual_seed(self.seed + self.epoch)
    idx = tensor.randperm(self.n, {generator = g}):totable()
  else
    idx = {}
    for i = 1, self.n do idx[i] = i end
  end
  local total = self.num_samples * self.world
  if self.drop_last then
    for i = #idx, total + 1, -1 do idx[i] = nil end
  else
    local k = 1
    while #idx < total do idx[#idx + 1] = idx[k]; k = k + 1 end -- pad by wrapping around
  end
  local mine = {}
  for i = self.rank + 1, total, self.world do mine[#mine + 1] = idx[i] end
  return mine
end

function Sampler:iter()
  local mine, i = self:indices(), 0
  return function()
    i = i + 1
    return mine[i]
  end
end

M.Sampler = Sampler

return M
