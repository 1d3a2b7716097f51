-- optim.ZeroRedundancyOptimizer (PyTorch's torch.distributed.optim's) in
-- worlds of real processes: training under DistributedDataParallel equals
-- plain DDP with the same optimizer, step by step and bit for bit, at 2 and 4
-- ranks, for Adam, SGD with momentum and AdamW with maximize, one broadcast
-- per parameter or one bucket per owner; each rank holds 1/N of the plain
-- optimizer's state bytes; consolidate_state_dict + state_dict on the target
-- rank equals the plain optimizer's state_dict, and load_state_dict takes it
-- back (training then goes on as the plain one's); the state saved as shards
-- with dist.checkpoint at 2 ranks loads at 4. Ported from PyTorch's
-- test/distributed/optim/test_zero_redundancy_optimizer.py (test_state_dict,
-- test_lr_scheduler, test_zero_grad, test_constructor, test_sharding,
-- test_add_param_group, test_multiple_param_groups, test_collect_shards,
-- test_nondefault_process_group, test_local_optimizer_parity, test_step_with_closure).
local S = require "spec.support"

local HEAD = S.prelude .. [[
  local tensor, nn, optim = require "tensor", require "nn", require "optim"
  dist.init_process_group{backend = "gloo"}
  local W = world_size
  -- 8 layers of one size: the sorted-greedy partition gives every rank of 2 or
  -- 4 the same number of elements
  local function model()
    tensor.manual_seed(3)
    local layers = {}
    for i = 1, 8 do
      layers[#layers + 1] = nn.Linear(16, 16)
      if i < 8 then layers[#layers + 1] = nn.Tanh() end
    end
    return nn.Sequential(unpack(layers))
  end
  local function state_bytes(opt)
    local b = 0
    for _, st in pairs(opt.state) do
      for _, v in pairs(st) do if tensor.is_tensor(v) then b = b + v:numel() * v:element_size() end end
    end
    return b
  end
  local function params_equal(a, b)
    local pa, pb = a:parameters(), b:parameters()
    if #pa ~= #pb then return false end
    for i = 1, #pa do if not pa[i]:equal(pb[i]) then return false end end
    return true
  end
  -- one step of DDP model m with optimizer o on this rank's batch of step s
  local function train_step(m, o, s)
    tensor.manual_seed(100 * s + rank)
    local x = tensor.randn(6, 16)
    o:zero_grad()
    local loss = m(x):pow(2):mean()
    loss:backward()
    o:step()
    return loss
  end
  -- two state_dicts the same: options, numbering, every state value
  local function sd_equal(a, b)
    if #a.param_groups ~= #b.param_groups then return false, "group count" end
    for gi, g in ipairs(a.param_groups) do
      local h = b.param_groups[gi]
      for k, v in pairs(g) do
        local w = h[k]
        if type(v) == "table" then
          for i = 1, math.max(#v, #w) do if v[i] ~= w[i] then return false, "group " .. gi .. " " .. k end end
        elseif v ~= w then return false, "group " .. gi .. " " .. k end
      end
      for k in pairs(h) do if g[k] == nil then return false, "group " .. gi .. " lacks " .. k end end
    end
    local n = 0
    for i, st in pairs(a.state) do
      n = n + 1
      local su = b.state[i]
      if not su then return false, "state " .. i .. " missing" end
      for k, v in pairs(st) do
        local w = su[k]
        if tensor.is_tensor(v) then
          if not (tensor.is_tensor(w) and v:equal(w)) then return false, "state " .. i .. " " .. k end
        elseif v ~= w then return false, "state " .. i .. " " .. k end
      end
    end
    for _ in pairs(b.state) do n = n - 1 end
    return n == 0, "state count"
  end
]]

local function world(n, body, opts)
  opts = opts or {}
  opts.timeout = opts.timeout or 180
  local r = S.world(n, HEAD .. body .. "\n  dist.destroy_process_group()\n", opts)
  assert.are.equal(0, r.status, r.out .. r.err)
  S.assert_checks(r, {times = n})
  return r
end

local PARITY = [[
  local configs = {
    {"Adam", optim.Adam, {lr = 0.01}},
    {"SGD with momentum", optim.SGD, {lr = 0.05, momentum = 0.9, weight_decay = 0.01}},
    {"AdamW maximizing", optim.AdamW, {lr = 0.01, maximize = true}},
    {"Adam, one bucket per owner", optim.Adam, {lr = 0.01}, true},
  }
  local differ, uneven, lost = {}, {}, {}
  for _, c in ipairs(configs) do
    local name, cls, o = c[1], c[2], c[3]
    local plain, sharded = nn.DistributedDataParallel(model()), nn.DistributedDataParallel(model())
    local po = cls(plain:parameters(), o)
    local zo_opts = {parameters_as_bucket_view = c[4]}
    for k, v in pairs(o) do zo_opts[k] = v end
    local zo = optim.ZeroRedundancyOptimizer(sharded:parameters(), cls, zo_opts)
    local same = true
    for s = 1, 4 do
      train_step(plain, po, s)
      train_step(sharded, zo, s)
      same = same and params_equal(plain, sharded)
    end
    if not same then differ[#differ + 1] = name end
    -- the state: this rank's is 1/W of the plain optimizer's, the ranks' together all of it
    local mine, full = state_bytes(zo), state_bytes(po)
    local total = tensor.tensor({mine}, {dtype = tensor.float64})
    dist.all_reduce(total)
    if not (full > 0 and mine * W == full) then uneven[#uneven + 1] = ("%s: %d of %d"):format(name, mine, full) end
    if total:item() ~= full then lost[#lost + 1] = name end
  end
  check("every step equals plain DDP's with the same optimizer", #differ == 0, table.concat(differ, "; "))
  check("this rank holds 1/N of the plain optimizer's state bytes", #uneven == 0, table.concat(uneven, "; "))
  check("the ranks together hold all of it", #lost == 0, table.concat(lost, "; "))
]]

describe("ZeroRedundancyOptimizer #world", function()
  it("trains as plain DDP with the same optimizer, each of 2 ranks holding half of the state", function()
    world(2, PARITY)
  end)

  it("trains as plain DDP with the same optimizer, each of 4 ranks holding a quarter of the state", function()
    world(4, PARITY)
  end)

  it("consolidates on the target rank the plain optimizer's state_dict, and loads it back", function()
    world(2, [[
      local plain, sharded = nn.DistributedDataParallel(model()), nn.DistributedDataParallel(model())
      local po = optim.Adam(plain:parameters(), {lr = 0.01, amsgrad = true})
      local zo = optim.ZeroRedundancyOptimizer(sharded:parameters(), optim.Adam, {lr = 0.01, amsgrad = true})
      for s = 1, 3 do train_step(plain, po, s); train_step(sharded, zo, s) end
      check("state_dict before consolidating is refused",
        raises(zo.state_dict, zo) and tostring(select(2, raises(zo.state_dict, zo))):find("consolidate_state_dict", 1, true))
      -- the target is 1 here: only there does state_dict answer
      zo:consolidate_state_dict(1)
      local sd
      if rank == 1 then
        sd = zo:state_dict()
        local ok, why = sd_equal(sd, po:state_dict())
        check("on the target rank it is the plain optimizer's state_dict", ok, why)
        -- saved as PyTorch's .pt, its state is the dict of states torch's load_state_dict takes
        local path = os.tmpname() .. ".pt"
        nn.save(sd, path)
        local back = nn.load(path)
        os.remove(path)
        local ok2, why2 = sd_equal(back, sd)
        check("it saves to a .pt with its state a dict, and loads back", ok2 and require("rpchost.mapping").kind(back.state) == "dict", why2)
      else
        local failed, e = raises(zo.state_dict, zo)
        check("on the target rank it is the plain optimizer's state_dict", failed and tostring(e):find("consolidate_state_dict(0)", 1, true), e)
        check("it saves to a .pt with its state a dict, and loads back", true)
      end
      local box = {sd}
      dist.broadcast_object_list(box, 1)
      sd = box[1]
      -- a new model and optimizer from it, and the original, go on alike
      local again = nn.DistributedDataParallel(model())
      do
        local src = sharded:parameters()
        tensor.no_grad(function() for i, p in ipairs(again:parameters()) do p:copy_(src[i]) end end)
      end
      local zo2 = optim.ZeroRedundancyOptimizer(again:parameters(), optim.Adam, {lr = 0.5})
      zo2:load_state_dict(sd)
      check("load_state_dict takes the groups' options", zo2.param_groups[1].lr == 0.01 and zo2.optim.param_groups[1].lr == 0.01)
      check("and only the owned parameters' state", state_bytes(zo2) == state_bytes(zo) and state_bytes(zo2) * W == state_bytes(po))
      local same = true
      for s = 4, 6 do
        train_step(plain, po, s); train_step(again, zo2, s)
        same = same and params_equal(plain, again)
      end
      check("training from the loaded state goes on as the plain optimizer's", same)
      -- a plain optimizer's state_dict loads too
      local third = nn.DistributedDataParallel(model())
      do
        local src = plain:parameters()
        tensor.no_grad(function() for i, p in ipairs(third:parameters()) do p:copy_(src[i]) end end)
      end
      local zo3 = optim.ZeroRedundancyOptimizer(third:parameters(), optim.Adam, {lr = 0.01, amsgrad = true})
      zo3:load_state_dict(po:state_dict())
      train_step(plain, po, 7); train_step(third, zo3, 7)
      check("a plain optimizer's state_dict loads", params_equal(plain, third))
      zo3:consolidate_state_dict(0)
      if rank == 0 then
        local ok, why = sd_equal(zo3:state_dict(), po:state_dict())
        check("and consolidates back to it", ok, why)
      else
        check("and consolidates back to it", true)
      end
    ]])
  end)

  it("partitions, adds groups, schedules, steps with a closure, and works on a subgroup, as PyTorch's", function()
    world(4, [[
      -- test_sharding: sizes 9, 7, 5, 3 per rank: each rank owns 24 elements
      local params = {}
      for _ = 1, W do for _, n in ipairs({9, 7, 5, 3}) do params[#params + 1] = tensor.rand(n, 1) end end
      local o = optim.ZeroRedundancyOptimizer(params, optim.SGD, {lr = 0.01})
      local owned = 0
      for _, p in ipairs(o.optim.param_groups[1].params) do owned = owned + p:numel() end
      check("sorted-greedy partition", owned == 24, owned)
      -- test_add_param_group: the new group's parameter goes where it evens things
      params = {}
      local sizes = {}
      for _ = 1, W do for _, n in ipairs({9, 7, 5, 3}) do sizes[#sizes + 1] = n end end
      for i = 1, #sizes - 1 do params[i] = tensor.rand(sizes[i], 1, {requires_grad = true}) end
      o = optim.ZeroRedundancyOptimizer(params, optim.SGD, {lr = 0.01})
      o:add_param_group({params = {tensor.rand(3, 1, {requires_grad = true})}})
      owned = 0
      for _, g in ipairs(o.optim.param_groups) do for _, p in ipairs(g.params) do owned = owned + p:numel() end end
      check("add_param_group", #o.param_groups == 2 and #o.optim.param_groups == 2 and owned == 24, owned)
      local part = o:_partition_parameters()
      local count = 0
      for r = 1, W do for _, g in ipairs(part[r]) do count = count + #g.params end end
      check("every parameter has one owner", count == #sizes)

      -- test_multiple_param_groups: groups upfront, added later, and a plain AdamW agree
      local function three() tensor.manual_seed(5); return nn.Sequential(nn.Linear(5, 10), nn.Linear(10, 10), nn.Linear(10, 5)) end
      local m1, m2, m3 = three(), three(), three()
      local function ws(m) local l = {}; for i = 1, 3 do l[i] = m[i].weight end; return l end
      local function bs(m) local l = {}; for i = 1, 3 do l[i] = m[i].bias end; return l end
      local o1 = optim.ZeroRedundancyOptimizer({{params = ws(m1), weight_decay = 0}, {params = bs(m1), weight_decay = 0.01}},
        optim.AdamW, {lr = 0.01})
      local o2 = optim.ZeroRedundancyOptimizer(ws(m2), optim.AdamW, {lr = 0.01, weight_decay = 0})
      o2:add_param_group({params = bs(m2), weight_decay = 0.01})
      local o3 = optim.AdamW({{params = ws(m3), weight_decay = 0}, {params = bs(m3), weight_decay = 0.01}}, {lr = 0.01})
      local same = true
      for s = 1, 3 do
        tensor.manual_seed(s) -- the same batch everywhere: no DDP here
        local x = tensor.randn(8, 5)
        for _, mo in ipairs({{m1, o1}, {m2, o2}, {m3, o3}}) do
          mo[2]:zero_grad(); mo[1](x):sum():backward(); mo[2]:step()
        end
        same = same and params_equal(m1, m3) and params_equal(m2, m3)
      end
      check("groups upfront, added, and a plain AdamW agree", same)
      check("every group has the class's options", o2.param_groups[2].betas[1] == 0.9 and o2.param_groups[2].weight_decay == 0.01)

      -- test_lr_scheduler: a scheduler drives it as a plain optimizer
      local x1 = tensor.tensor({1.0}, {requires_grad = true})
      local x2 = tensor.tensor({1.0}, {requires_grad = true})
      local zo = optim.ZeroRedundancyOptimizer({x1}, optim.SGD, {lr = 0.01})
      local so = optim.SGD({x2}, {lr = 0.01})
      local s1, s2 = optim.lr_scheduler.StepLR(zo, 1), optim.lr_scheduler.StepLR(so, 1)
      same = true
      for _ = 1, 5 do
        x1:backward(); zo:step(); zo:zero_grad(); s1:step()
        x2:backward(); so:step(); so:zero_grad(); s2:step()
        same = same and x1:equal(x2)
      end
      check("lr_scheduler", same and zo.param_groups[1].lr == so.param_groups[1].lr, x1:item() .. " " .. x2:item())

      -- test_zero_grad
      local lin = nn.Linear(1, 1)
      zo = optim.ZeroRedundancyOptimizer(lin:parameters(), optim.SGD, {lr = 0.01})
      lin(tensor.rand(1)):backward()
      zo:zero_grad()
      check("zero_grad clears every parameter's gradient", lin.weight.grad == nil and lin.bias.grad == nil)

      -- test_step_with_closure: the closure's loss comes back, every rank ends equal
      local target_err = 1.0
      local m = nn.Linear(1, 1)
      tensor.no_grad(function() m.weight:fill_(1); m.bias:fill_(2) end)
      zo = optim.ZeroRedundancyOptimizer(m:parameters(), optim.SGD, {lr = 0.1})
      local xr = tensor.tensor({rank + 1.0})
      local target = tensor.tensor({(rank + 1) * 1 + 2 + target_err})
      local loss = zo:step(function()
        zo:zero_grad()
        local l = nn.L1Loss()(m(xr), target)
        l:backward()
        for _, p in ipairs(m:parameters()) do dist.all_reduce(p.grad); p.grad:div_(W) end
        return l
      end)
      check("step(closure) returns the loss", math.abs(loss:item() - target_err) < 1e-6, loss)
      check("and steps", math.abs(m.weight:item() - (1 + 0.1 * (W + 1) / 2)) < 1e-6 and math.abs(m.bias:item() - 2.1) < 1e-6,
        m.weight:item())

      -- test_nondefault_process_group: the even ranks only
      local sub = dist.new_group({0, 2})
      if rank % 2 == 0 then
        tensor.manual_seed(rank)
        local mm = nn.Sequential(nn.Linear(20, 10), nn.Linear(10, 5))
        tensor.no_grad(function() for _, p in ipairs(mm:parameters()) do dist.broadcast(p, 0, {group = sub}) end end)
        local zs = optim.ZeroRedundancyOptimizer(mm:parameters(), optim.SGD, {lr = 1e-3, momentum = 0.99, process_group = sub})
        check("a subgroup's ranks", zs.rank == rank / 2 and zs.world_size == 2 and zs.global_rank == rank)
        local agree = true
        for _ = 1, 3 do
          local xb, tb = tensor.rand(3, 20), tensor.rand(3, 5)
          zs:step(function()
            zs:zero_grad()
            local l = nn.L1Loss()(mm(xb), tb)
            l:backward()
            return l
          end)
          for _, p in ipairs(mm:parameters()) do
            local l = {tensor.zeros_like(p), tensor.zeros_like(p)}
            dist.all_gather(l, p:detach(), {group = sub})
            agree = agree and l[1]:equal(l[2])
          end
        end
        check("on a subgroup the replicas stay equal", agree)
      else
        check("a subgroup's ranks", true)
        check("on a subgroup the replicas stay equal", true)
      end

      -- test_constructor: what is refused, and why
      local lm = nn.Linear(2, 2)
      local function err(...) local failed, e = raises(optim.ZeroRedundancyOptimizer, ...); return failed and tostring(e) or "" end
      check("an empty list", err({}, optim.SGD, {lr = 0.1}):find("empty parameter list", 1, true))
      check("a number among the parameters", err({lm.weight, 42}, optim.SGD, {lr = 0.1}):find("parameter 2 of group 1 is a number", 1, true))
      check("a class that is not one", err(lm, 42, {lr = 0.1}):find("optimizer_class must be", 1, true))
      check("overlap_with_ddp", err(lm, optim.SGD, {lr = 0.1, overlap_with_ddp = true}):find("overlap_with_ddp", 1, true))
      check("the local optimizer's own checks", err(lm, optim.SGD, {}):find("lr is required", 1, true))
      check("a parameter in two groups", err({{params = {lm.weight}}, {params = {lm.weight}}}, optim.SGD, {lr = 0.1}):find("more than one", 1, true))
      check("groups of dicts and PyTorch's keywords",
        #optim.ZeroRedundancyOptimizer({{params = {lm.weight}}, {params = {lm.bias}}}, {optimizer_class = optim.SGD, lr = 0.1}).param_groups == 2)
    ]])
  end)

  it("saves its shards with dist.checkpoint at 2 ranks and loads them, re-sharded, at 4", function()
    local dir = S.tmpdir .. "/zero_dcp"
    os.execute("rm -rf " .. dir)
    world(2, [[
      local m = nn.DistributedDataParallel(model())
      local zo = optim.ZeroRedundancyOptimizer(m:parameters(), optim.Adam, {lr = 0.02})
      for s = 1, 3 do train_step(m, zo, s) end
      local sd = zo:sharded_state_dict()
      local shards = 0
      for _, st in pairs(sd.state) do for _, v in pairs(st) do if dist.checkpoint.is_shard(v) then shards = shards + 1 end end end
      check("only the owned state, as shards", shards == 3 * 16 / W, shards)
      dist.checkpoint.save({optim = sd, model = m.module:state_dict()}, os.getenv("CKDIR"))
      -- (what the 4 ranks must find: the first parameter's state, whoever owns it)
      zo:consolidate_state_dict(0)
      if rank == 0 then
        local st = zo:state_dict().state[1]
        nn.save({exp_avg = st.exp_avg, exp_avg_sq = st.exp_avg_sq}, os.getenv("CKDIR") .. "_state1.npz")
      end
      check("saved", true)
    ]], {env = {CKDIR = dir}})
    world(4, [[
      local m = model()
      local zo = optim.ZeroRedundancyOptimizer(m:parameters(), optim.Adam, {lr = 0.5})
      local sd = {optim = zo:sharded_state_dict(), model = m:state_dict()}
      dist.checkpoint.load(sd, os.getenv("CKDIR"))
      m:load_state_dict(sd.model)
      zo:load_sharded_state_dict(sd.optim)
      check("the options come back", zo.param_groups[1].lr == 0.02)
      zo:consolidate_state_dict(0)
      if rank == 0 then
        local st = zo:state_dict().state[1]
        local want = nn.load(os.getenv("CKDIR") .. "_state1.npz")
        check("the state comes back, whatever rank now owns it", st.step == 3 and st.exp_avg:equal(want.exp_avg)
          and st.exp_avg_sq:equal(want.exp_avg_sq), st.step)
      else
        check("the state comes back, whatever rank now owns it", true)
      end
    ]], {env = {CKDIR = dir}})
  end)
end)
