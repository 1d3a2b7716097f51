-- rpchost.nn.pipe_schedule: the order in which each stage of an nn.Pipe runs
-- its micro-batches. A stage's program is a list of ops: i > 0 is the forward
-- of micro-batch i, -i its backward. Every stage runs its own list in order,
-- each op as soon as what it needs has come (the activation from the stage
-- before, the gradient from the stage after), so the lists alone make the
-- schedule, on one process or across workers.
--
-- GPipe (fill-drain; Huang et al. 2019, torchgpipe): every forward, then every
-- backward, last micro-batch first. A stage holds the activations of all M
-- micro-batches at the turn. The forwards alone (pipe(x)) are GPipe's clock
-- cycles: at cycle k stage j runs micro-batch k - j + 1.
--
-- 1F1B (PipeDream-flush; Narayanan et al. 2021, as Megatron-LM runs it):
-- stage j of S first runs min(S - j, M) forwards (the warm-up that fills the
-- pipe below it), then alternates one forward and one backward, then runs the
-- backwards left. Stage j never holds more than S - j + 1 micro-batches'
-- activations, instead of M; the bubble, (S - 1) / (M + S - 1) of a step, is
-- GPipe's.
local M = {}

M.SCHEDULES = {gpipe = true, ["1f1b"] = true}

local function forwards(ops, first, last)
  for i = first, last do ops[#ops + 1] = i end
end

-- ops(schedule, phase, S, j, m): stage j's list for m micro-batches; phase
-- "forward" (pipe(x): forwards only) or "train" (forwards and backwards)
function M.ops(schedule, phase, S, j, m)
  local ops = {}
  if phase == "forward" then
    forwards(ops, 1, m)
  elseif schedule == "gpipe" then
    forwards(ops, 1, m)
    for i = m, 1, -1 do ops[#ops + 1] = -i end
  else
    local warm = math.min(S - j, m)
    forwards(ops, 1, warm)
    for k = 1, m - warm do
      ops[#ops + 1] = warm + k
      ops[#ops + 1] = -k
    end
    for i = m - warm + 1, m do ops[#ops + 1] = -i end
  end
  return ops
end

-- GPipe's bubble: the share of a step each stage idles, (S - 1) / (M + S - 1)
function M.bubble(S, m) return (S - 1) / (m + S - 1) end

return M
