-- rpchost.env: where a rank learns who it is and where its world meets:
-- torchrun's variables, else Slurm's, else Open MPI's; init_method URLs.
local errors = require "rpchost.errors"

local M = {}

local function first(...)
  for i = 1, select("#", ...) do
    local v = os.getenv((select(i, ...)))
    if v and v ~= "" then return v, (select(i, ...)) end
  end
end

local function int_of(v, what)
  if v == nil then return nil end
  local n = tonumber(v)
  if not n or n ~= math.floor(n) then
    error(errors.new("config", ("%s must be an integer, got '%s'"):format(what, tostring(v))), 0)
  end
  return n
end

function M.rank()
  local v, name = first("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
  return int_of(v, name or "RANK")
end

function M.world_size()
  local v, name = first("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
  return int_of(v, name or "WORLD_SIZE")
end

function M.local_rank()
  local v, name = first("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
  return int_of(v, name or "LOCAL_RANK")
end

-- host, port of an init_method ("env://" or "tcp://host:port"; nil means env://).
function M.master(init_method)
  init_method = init_method or "env://"
  if init_method == "env://" then
    local addr, port = os.getenv("MASTER_ADDR"), os.getenv("MASTER_PORT")
    local missing = {}
    if not addr or addr == "" then missing[#missing + 1] = "MASTER_ADDR" end
    if not port or port == "" then missing[#missing + 1] = "MASTER_PORT" end
    if #missing > 0 then
      error(errors.new("config", ("%s %s not set: init_method env:// needs MASTER_ADDR and " ..
        "MASTER_PORT (start the ranks with `rpchost run`, export both, or pass " ..
        "init_method = \"tcp://host:port\")"):format(table.concat(missing, " and "),
        #missing == 1 and "is" or "are")), 0)
    end
    local p = tonumber(port)
    if not p or p < 1 or p > 65535 or p ~= math.floor(p) then
      error(errors.new("config", ("MASTER_PORT must be a port number (1-65535), got '%s'"):format(port)), 0)
    end
    return addr:match("^%[(.+)%]$") or addr, p -- (an IPv6 address may come bracketed)
  end
  local host, port = init_method:match("^tcp://%[?([^%]]-)%]?:(%d+)$")
  if not host then
    error(errors.new("config", ("init_method '%s' is not understood: use \"env://\" or " ..
      "\"tcp://host:port\""):format(init_method)), 0)
  end
  return host, tonumber(port)
end

function M.init_timeout(opt)
  return tonumber(opt) or tonumber(os.getenv("RPCHOST_INIT_TIMEOUT")) or 300
end

return M
