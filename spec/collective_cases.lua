-- spec/collective_cases.lua: the body of a world script that runs every
-- collective on every dtype and checks each result exactly (a process group must
-- be initialised first). Shared by the gloo specs (spec/collectives_spec.lua) and
-- the mpi backend's (spec/mpi_spec.lua).
return [[
  local DT = {"float32", "float64", "int32", "int64", "uint8", "bool"}
  local n, me = world_size, rank
  local function value(r, i, dt)
    if dt == "bool" then return (r + i) % 2 == 0 end
    return ((r + i) % 3) + 1
  end
  local function input(r, size, dt)
    local v = {}
    for i = 1, size do v[i] = value(r, i, dt) end
    return tensor.tensor(v, {dtype = tensor[dt]})
  end
  local function fold(op, a, b, dt)
    if dt == "bool" then
      if op == "SUM" or op == "MAX" then return a or b end
      return a and b
    end
    if op == "SUM" or op == "AVG" then return a + b end
    if op == "PRODUCT" then return a * b end
    if op == "MIN" then return math.min(a, b) end
    return math.max(a, b)
  end
  local function expected(op, size, dt)
    local out = {}
    for i = 1, size do
      local acc = value(0, i, dt)
      for r = 1, n - 1 do acc = fold(op, acc, value(r, i, dt), dt) end
      if op == "AVG" then acc = acc / n end
      out[i] = acc
    end
    return out
  end
  local function same(t, want)
    local got = t:totable()
    if #got ~= #want then return false end
    for i = 1, #want do
      local a, b = got[i], want[i]
      if type(a) == "number" and type(b) == "number" then
        if math.abs(a - b) > 1e-6 * math.max(1, math.abs(b)) then return false end
      elseif a ~= b then return false end
    end
    return true
  end
  for _, size in ipairs({1, 7, 1001}) do
    for _, dt in ipairs(DT) do
      local tag = ("%s[%d]"):format(dt, size)
      for _, op in ipairs({"SUM", "PRODUCT", "MIN", "MAX", "AVG"}) do
        if op ~= "AVG" or dt == "float32" or dt == "float64" then
          local t = input(me, size, dt)
          dist.all_reduce(t, dist.ReduceOp[op])
          check("all_reduce " .. op .. " " .. tag, same(t, expected(op, size, dt)), t)
        end
      end
      local root = (size + 1) % n
      local t = input(me, size, dt)
      dist.reduce(t, root, dist.ReduceOp.SUM)
      check("reduce " .. tag, me ~= root or same(t, expected("SUM", size, dt)))
      local b = me == root and input(me, size, dt) or tensor.zeros(size, {dtype = tensor[dt]})
      dist.broadcast(b, root)
      check("broadcast " .. tag, same(b, input(root, size, dt):totable()))
      local list = {}
      for r = 1, n do list[r] = tensor.zeros(size, {dtype = tensor[dt]}) end
      dist.all_gather(list, input(me, size, dt))
      local ok = true
      for r = 0, n - 1 do ok = ok and same(list[r + 1], input(r, size, dt):totable()) end
      check("all_gather " .. tag, ok)
      local glist = nil
      if me == root then
        glist = {}
        for r = 1, n do glist[r] = tensor.zeros(size, {dtype = tensor[dt]}) end
      end
      dist.gather(input(me, size, dt), glist, root)
      ok = true
      if me == root then for r = 0, n - 1 do ok = ok and same(glist[r + 1], input(r, size, dt):totable()) end end
      check("gather " .. tag, ok)
      local slist = nil
      if me == root then
        slist = {}
        for r = 0, n - 1 do slist[r + 1] = input(r + 10, size, dt) end
      end
      local s = tensor.zeros(size, {dtype = tensor[dt]})
      dist.scatter(s, slist, root)
      check("scatter " .. tag, same(s, input(me + 10, size, dt):totable()))
      -- reduce_scatter: rank r contributes input(r + 20*j) for destination j
      local rs = {}
      for j = 0, n - 1 do rs[j + 1] = input(me + 20 * j, size, dt) end
      local out = tensor.zeros(size, {dtype = tensor[dt]})
      dist.reduce_scatter(out, rs, dist.ReduceOp.MAX)
      local want = {}
      for i = 1, size do
        local acc = value(20 * me, i, dt)
        for r = 1, n - 1 do acc = fold("MAX", acc, value(r + 20 * me, i, dt), dt) end
        want[i] = acc
      end
      check("reduce_scatter " .. tag, same(out, want))
    end
  end
]]
