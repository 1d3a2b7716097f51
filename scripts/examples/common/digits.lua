-- examples/common/digits.lua: the 8x8 handwritten digits that Debian's
-- python3-sklearn ships (sklearn/datasets/data/digits.csv.gz: 1797 rows of 64
-- pixels in 0..16 and a label), standing in for MNIST, which cannot be
-- downloaded here. Every fifth sample is the test set, the rest the training
-- set (the twin, bench/tutorials/digits.py, splits the same way). Pixels are
-- scaled to [0, 1] and normalised with the training set's mean and std, as
-- the tutorial's transforms.Normalize does for MNIST.
local tensor = require "tensor"

local M = {}

M.default_path = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"

local function read_gz(path)
  local f = io.open(path, "rb")
  if not f then
    error(("digits: %s not found: install Debian's python3-sklearn (apt-get install python3-sklearn, or " ..
      "bash scripts/setup.sh), or set RPCHOST_DIGITS to the file"):format(path), 0)
  end
  f:close()
  local p = io.popen("gzip -dc '" .. path:gsub("'", "'\\''") .. "' 2>&1")
  local text = p:read("*a")
  local ok = p:close()
  if not ok then error(("digits: cannot decompress %s with gzip: %s"):format(path, text:sub(1, 200)), 0) end
  return text
end

-- load() -> {train = {x, y}, test = {x, y}}: x [N, 1, 8, 8] float32, y [N] int64
-- labels as Lua class indices 1..10 (digit d is class d + 1)
function M.load(path)
  path = path or os.getenv("RPCHOST_DIGITS") or M.default_path
  local rows = {train = {x = {}, y = {}}, test = {x = {}, y = {}}}
  local i = 0
  for line in read_gz(path):gmatch("[^\n]+") do
    local v = {}
    for n in line:gmatch("[^,]+") do v[#v + 1] = tonumber(n) end
    if #v ~= 65 then error(("digits: %s line %d has %d fields, expected 65"):format(path, i + 1, #v), 0) end
    local label = v[65]
    v[65] = nil
    local part = (i % 5 == 0) and rows.test or rows.train
    part.x[#part.x + 1] = v
    part.y[#part.y + 1] = label + 1
    i = i + 1
  end
  local out = {}
  for name, part in pairs(rows) do
    out[name] = {x = tensor.tensor(part.x):div(16):view(-1, 1, 8, 8),
                 y = tensor.tensor(part.y, {dtype = tensor.int64})}
  end
  local mean, std = out.train.x:mean():item(), out.train.x:std():item()
  for _, part in pairs(out) do part.x = (part.x - mean) / std end
  return out
end

return M
