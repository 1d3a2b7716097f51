-- rpchost.mapping: which Lua tables stand for Python dicts even where their keys
-- look like a list's. Lua has one table type; Python has lists and dicts. A table
-- whose keys are exactly 1..n is ambiguous: an optimizer's state keyed by
-- parameter numbers 1..n is a dict to PyTorch, a list of betas is a list. The
-- code that makes such a mapping says so here (Optimizer:state_dict() marks its
-- `state`; a .pt load marks every dict it reads), and the writers of Python's
-- formats (rpchost.tensor.pickle) ask. The marks are weak: they go with the table.
local M = {}

local kinds = setmetatable({}, {__mode = "k"})

-- mark(t, [kind]): t is a Python dict ("dict", the default) or an
-- "OrderedDict"; returns t
function M.mark(t, kind)
  kinds[t] = kind or "dict"
  return t
end

-- the kind t was marked with, or nil
function M.kind(t) return kinds[t] end

return M
