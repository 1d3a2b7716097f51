-- rpchost.slurm: what Slurm tells a process about the job step it runs in, read
-- from the variables srun sets (never by running scontrol: a rank starts in
-- milliseconds, and a compute node may not even have the client tools).
--
-- The step, not the job: the batch script of `sbatch -n 4` has SLURM_PROCID=0
-- and SLURM_NTASKS=4 too, but it is no rank of anything; only srun's tasks have
-- SLURM_STEP_ID, and only their SLURM_STEP_* describe the step they are in
-- (`srun -n 2` inside `sbatch -n 4` is a world of 2). A process in an
-- allocation but outside any step (the batch script, a shell of salloc) is a
-- world of its own.
--
-- Every function takes the variables through `getenv` (os.getenv by default),
-- so the specs can hand it any environment.
local M = {}

-- Where a step's store listens when nothing says otherwise: a port derived from
-- the job and step ids, so that two steps of one job, and two jobs sharing a
-- node, meet at different ports (docs/slurm.md). Below Linux's ephemeral range
-- (32768-60999), where no client connection is ever given one of them.
M.PORT_BASE, M.PORT_SPAN = 20000, 10000
-- (steps of one job below 64 apart, and jobs below 625 apart, never share one)
M.STEPS_PER_JOB = 64

local function int(v)
  local n = tonumber(v)
  if n and n == math.floor(n) then return n end
end

-- Host lists -------------------------------------------------------------------
-- Slurm writes node lists compressed: "node[01-04,07],login1,rack[1-2]-n[1-3]"
-- (a bracket holds numbers and ranges, zero-padded to the lower bound's width;
-- several brackets in one name multiply). Returns the hosts in Slurm's order,
-- at most `limit` of them (the first host needs no expansion of the rest), or
-- nil and why the text is not a host list.

-- "01-04,07" -> {"01", "02", "03", "04", "07"} (at most limit), or nil, why
local function expand_ranges(body, limit)
  local out = {}
  for part in (body .. ","):gmatch("([^,]*),") do
    local lo, hi = part:match("^%s*(%d+)%-(%d+)%s*$")
    if not lo then lo = part:match("^%s*(%d+)%s*$"); hi = lo end
    if not lo then return nil, ("'%s' is not a number or a range"):format(part) end
    local a, b = tonumber(lo), tonumber(hi)
    if b < a then return nil, ("the range %s counts down"):format(part) end
    for n = a, b do
      if #out >= limit then return out end
      out[#out + 1] = ("%0" .. #lo .. "d"):format(n)
    end
  end
  return out
end

-- one name with brackets in it -> its hosts (at most limit)
local function expand_name(name, limit)
  local pre, body, rest = name:match("^([^%[]*)%[([^%]]*)%](.*)$")
  if not pre then
    if name:find("[%[%]]") then return nil, ("unbalanced brackets in '%s'"):format(name) end
    return {name}
  end
  local nums, why = expand_ranges(body, limit)
  if not nums then return nil, why end
  local out = {}
  for _, n in ipairs(nums) do
    local tails, twhy = expand_name(rest, limit - #out)
    if not tails then return nil, twhy end
    for _, t in ipairs(tails) do
      if #out >= limit then return out end
      out[#out + 1] = pre .. n .. t
    end
  end
  return out
end

function M.hosts(list, limit)
  limit = limit or math.huge
  if type(list) ~= "string" or list:match("^%s*$") then return nil, "the host list is empty" end
  local out, depth, start = {}, 0, 1
  local names = {}
  -- (commas inside brackets separate numbers, not names)
  for i = 1, #list + 1 do
    local c = list:sub(i, i)
    if c == "[" then depth = depth + 1
    elseif c == "]" then depth = depth - 1
    elseif (c == "," and depth == 0) or c == "" then
      names[#names + 1] = list:sub(start, i - 1)
      start = i + 1
    end
    if depth < 0 or depth > 1 then return nil, ("unbalanced brackets in '%s'"):format(list) end
  end
  for _, name in ipairs(names) do
    name = name:match("^%s*(.-)%s*$")
    if name == "" then return nil, ("an empty name in '%s'"):format(list) end
    local hs, why = expand_name(name, limit - #out)
    if not hs then return nil, why end
    for _, h in ipairs(hs) do out[#out + 1] = h end
    if #out >= limit then break end
  end
  return out
end

-- The first host of a list, or nil, why.
function M.first_host(list)
  local hs, why = M.hosts(list, 1)
  if not hs then return nil, why end
  return hs[1]
end

-- Tasks per node -----------------------------------------------------------------
-- SLURM_STEP_TASKS_PER_NODE: "2(x3),1" -> {2, 2, 2, 1}, or nil, why.
function M.tasks_per_node(s)
  if type(s) ~= "string" or s == "" then return nil, "it is empty" end
  local out = {}
  for part in (s .. ","):gmatch("([^,]*),") do
    local n, times = part:match("^%s*(%d+)%(x(%d+)%)%s*$")
    if not n then n, times = part:match("^%s*(%d+)%s*$"), "1" end
    if not n then return nil, ("'%s' is not a count or count(xtimes)"):format(part) end
    for _ = 1, tonumber(times) do out[#out + 1] = tonumber(n) end
  end
  return out
end

-- The step -----------------------------------------------------------------------
local function first_of(getenv, ...)
  for i = 1, select("#", ...) do
    local name = select(i, ...)
    local v = getenv(name)
    if v and v ~= "" then return v, name end
  end
end

-- The job this process is in (an allocation: batch script, salloc's shell, or a
-- step of it), or nil.
function M.job_id(getenv)
  getenv = getenv or os.getenv
  return (first_of(getenv, "SLURM_JOB_ID", "SLURM_JOBID"))
end

-- What the step this process is a task of says, or nil outside any step:
-- {job, step, rank, size, local_rank, local_size, node, nnodes, nodes (the
-- compressed list), cpus_per_task, vars = {field = the variable read}}.
-- Fields Slurm did not set are nil.
function M.step(getenv)
  getenv = getenv or os.getenv
  local job = M.job_id(getenv)
  local step, step_var = first_of(getenv, "SLURM_STEP_ID", "SLURM_STEPID")
  if not (job and step) then return nil end
  local s = {job = job, step = step, vars = {step = step_var}}
  local function take(field, conv, ...)
    local v, name = first_of(getenv, ...)
    if v ~= nil then
      s[field] = conv(v)
      s.vars[field] = name
    end
  end
  take("rank", int, "SLURM_PROCID")
  take("size", int, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
  take("local_rank", int, "SLURM_LOCALID")
  take("node", int, "SLURM_NODEID")
  take("nnodes", int, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
  take("nodes", tostring, "SLURM_STEP_NODELIST", "SLURM_NODELIST")
  take("cpus_per_task", int, "SLURM_CPUS_PER_TASK")
  local tpn, tpn_var = first_of(getenv, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
  local counts = tpn and M.tasks_per_node(tpn)
  if counts and s.node and counts[s.node + 1] then
    s.local_size = counts[s.node + 1]
    s.vars.local_size = tpn_var .. " and SLURM_NODEID"
  end
  return s
end

-- The port a step's store listens at when MASTER_PORT is not set.
function M.port(job, step)
  local j, st = int(job) or 0, int(step) or 0
  return M.PORT_BASE + (j * M.STEPS_PER_JOB + st % M.STEPS_PER_JOB) % M.PORT_SPAN
end

-- The name of a step's world, as the handshake carries it and errors show it.
function M.world_name(job, step)
  return ("slurm job %s step %s"):format(job, step)
end

return M
