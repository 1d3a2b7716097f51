-- Tensors sent as one flat tensor per dtype and device: DDP's buffer broadcast
-- and ZeroRedundancyOptimizer's parameter broadcast move many small tensors,
-- and one collective per bucket costs far less than one per tensor.
local M = {}

-- the tensors of list grouped by dtype and device, in first-seen order: each
-- bucket is an array of its tensors with n, their elements in all
function M.by_dtype_device(list)
  local buckets, order = {}, {}
  for _, t in ipairs(list) do
    local key = tostring(t.dtype) .. "@" .. tostring(t.device)
    local b = buckets[key]
    if not b then
      b = {n = 0}
      buckets[key] = b
      order[#order + 1] = b
    end
    b[#b + 1] = t
    b.n = b.n + t:numel()
  end
  return order
end

-- copies the bucket's tensors into flat (1-D, n elements), one after another
function M.pack(bucket, flat)
  local off = 1
  for _, t in ipairs(bucket) do
    if t:numel() > 0 then flat:narrow(1, off, t:numel()):copy_(t:reshape(-1)) end
    off = off + t:numel()
  end
  return flat
end

-- copies flat's pieces back into the bucket's tensors, in their shapes
function M.unpack(flat, bucket)
  local off = 1
  for _, t in ipairs(bucket) do
    if t:numel() > 0 then t:copy_(flat:narrow(1, off, t:numel()):view(t:size())) end
    off = off + t:numel()
  end
end

return M
