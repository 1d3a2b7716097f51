-- `#` on every object the documentation says it counts, as Python's len():
-- DistributedSampler and the other samplers, DataLoader (batches), datasets,
-- nn.Sequential / ModuleList / ModuleDict (rpchost.sized: LuaJIT ignores __len
-- on tables, so these are userdata proxies), and tensor.Size (a plain list).
-- What the proxies must keep: fields, methods, class checks, tostring, calls,
-- deepcopy, optimizers over them, and travelling over RPC as the objects they
-- stand for.
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local dist = require "dist"
local codec = require "rpchost.wire.codec"
local S = require "spec.support"

local D = tensor.data
local function roundtrip(v) return (codec.decode(codec.encode("value", v))) end

describe("# counts sized objects #unit", function()
  it("of a DistributedSampler: this rank's count, with and without drop_last", function()
    -- 10 items over 3 ranks: padded to 4 each, or 3 each when the tail is dropped
    for rank = 0, 2 do
      local s = dist.DistributedSampler(10, {rank = rank, world_size = 3})
      assert.are.equal(4, #s)
      assert.are.equal(#s:indices(), #s)
      assert.are.equal(s:len(), #s)
      local d = dist.DistributedSampler(10, {rank = rank, world_size = 3, drop_last = true})
      assert.are.equal(3, #d)
      assert.are.equal(#d:indices(), #d)
    end
    -- PyTorch's signature, over a dataset
    local ds = D.TensorDataset(tensor.arange(1, 8))
    assert.are.equal(4, #D.DistributedSampler(ds, {num_replicas = 2, rank = 1}))
    assert.are.equal(3, #D.DistributedSampler(ds, {num_replicas = 2, rank = 1, drop_last = true}))
    assert.are.equal(0, #dist.DistributedSampler(0, {rank = 0, world_size = 2}))
  end)

  it("keeps a DistributedSampler an object of its class: fields, methods, set_epoch, tostring", function()
    local Sampler = require("rpchost.dist.sampler").Sampler
    local s = dist.DistributedSampler(10, {rank = 1, world_size = 3, seed = 4})
    assert.are.equal(Sampler, getmetatable(s))
    assert.are.equal(10, s.n)
    assert.are.equal(1, s.rank)
    local e0 = s:indices()
    s:set_epoch(1)
    assert.are.equal(1, s.epoch)
    assert.are_not.same(e0, s:indices())
    local seen = {}
    for i in s:iter() do seen[#seen + 1] = i end
    assert.are.same(s:indices(), seen)
    assert.truthy(tostring(s):find("^DistributedSampler: 0x"))
    assert.are.equal(s, s)
    assert.are_not.equal(s, dist.DistributedSampler(10, {rank = 1, world_size = 3, seed = 4}))
  end)

  it("of a DataLoader: its batches per epoch, with a sampler too", function()
    local ds = D.TensorDataset(tensor.arange(1, 11))
    assert.are.equal(4, #D.DataLoader(ds, {batch_size = 3}))
    assert.are.equal(3, #D.DataLoader(ds, {batch_size = 3, drop_last = true}))
    assert.are.equal(10, #D.DataLoader(ds))
    assert.are.equal(1, #D.DataLoader(ds, {batch_size = 10}))
    local s = D.DistributedSampler(ds, {num_replicas = 3, rank = 2, shuffle = false})
    local loader = D.DataLoader(ds, {batch_size = 3, sampler = s})
    assert.are.equal(2, #loader) -- 4 indices: a batch of 3 and one of 1
    local batches = 0
    for _ in loader:iter() do batches = batches + 1 end
    assert.are.equal(#loader, batches)
    assert.are.equal(1, #D.DataLoader(ds, {batch_size = 2, sampler = {3, 1}}))
    assert.are.equal(loader:len(), #loader)
    assert.truthy(tostring(loader):find("^DataLoader: 0x"))
  end)

  it("of datasets and samplers: TensorDataset, Subset, random_split, RandomSampler, SequentialSampler", function()
    local ds = D.TensorDataset(tensor.arange(1, 11), tensor.zeros(10, 2))
    assert.are.equal(10, #ds)
    assert.are.equal(ds:len(), #ds)
    local sub = D.Subset(ds, {2, 4, 6})
    assert.are.equal(3, #sub)
    assert.are.equal(4, sub:get(2)[1]:item())
    local a, b = unpack(D.random_split(ds, {3, 7}, {seed = 1}))
    assert.are.equal(3, #a)
    assert.are.equal(7, #b)
    local seen = {}
    for x in D.DataLoader(b, {batch_size = 4}):iter() do
      for _, v in ipairs(x:totable()) do seen[#seen + 1] = v end
    end
    assert.are.equal(7, #seen)
    local r = D.RandomSampler(ds, {seed = 3})
    assert.are.equal(10, #r)
    assert.are.same(r:indices(), D.RandomSampler(10, {seed = 3}):indices())
    local q = D.SequentialSampler(4)
    assert.are.equal(4, #q)
    assert.are.same({1, 2, 3, 4}, q:indices())
    assert.are.same({1, 2, 3, 4, 5}, D.DataLoader(D.TensorDataset(tensor.arange(1, 6)),
      {batch_size = 5, sampler = D.SequentialSampler(5)}):indices())
    -- a user's dataset (a table with len and get) and a plain list still work
    local mine = {len = function() return 3 end, get = function(_, i) return i * 10 end}
    local got = {}
    for x in D.DataLoader(mine, {batch_size = 2}):iter() do
      for _, v in ipairs(x:totable()) do got[#got + 1] = v end
    end
    assert.are.same({10, 20, 30}, got)
    assert.are.equal(2, #D.DataLoader({5, 6, 7}, {batch_size = 2}))
  end)

  it("of nn.Sequential, ModuleList and ModuleDict (and a class extending one), which stay modules", function()
    local seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert.are.equal(3, #seq)
    assert.are.equal(seq:len(), #seq)
    assert.is_true(nn.is_module(seq))
    assert.are.equal(nn.Sequential, getmetatable(seq))
    assert.are.equal(3, seq[1].out_features)
    assert.are.same({1, 1}, {seq(tensor.ones(1, 2)):size()[1], seq(tensor.ones(1, 2)):size()[2]})
    assert.truthy(tostring(seq):find("^Sequential%("))
    seq:append(nn.Tanh())
    assert.are.equal(4, #seq)
    assert.are.equal(4, #nn.Sequential({{"fc", nn.Linear(1, 1)}, {"a", nn.ReLU()}, {"b", nn.ReLU()}, {"c", nn.ReLU()}}))
    assert.are.equal(0, #nn.Sequential())
    local list = nn.ModuleList({nn.ReLU(), nn.ReLU()})
    assert.are.equal(2, #list)
    list:extend({nn.Tanh()})
    assert.are.equal(3, #list)
    local dict = nn.ModuleDict({a = nn.ReLU(), b = nn.Linear(1, 1)})
    assert.are.equal(2, #dict)
    assert.are.equal(2, dict:len())
    -- a user's class extending Sequential, with fields of its own
    local Net = nn.Sequential:extend("SizedSpecNet")
    function Net:__init(width)
      nn.Sequential.__init(self, nn.Linear(width, width), nn.ReLU())
      self.width = width
    end
    local net = Net(4)
    assert.are.equal(2, #net)
    assert.are.equal(4, net.width)
    assert.are.equal(2, #net:parameters())
    -- what the model code does with them: train/eval, state_dict, deepcopy, an optimizer
    seq:eval()
    assert.is_false(seq.training)
    assert.is_false(seq[1].training)
    local sd = seq:state_dict()
    assert.truthy(sd["0.weight"])
    local copy = seq:deepcopy()
    assert.are.equal(4, #copy)
    assert.is_true(copy[1].weight:equal(seq[1].weight))
    assert.are_not.equal(copy[1].weight, seq[1].weight)
    local opt = optim.SGD(seq, {lr = 0.1})
    assert.are.equal(4, #opt.param_groups[1].params)
    local ddp_like = nn.utils.parameters_to_vector(seq)
    assert.are.equal(13, ddp_like:numel())
  end)

  it("of a Size: its dimensions, and a Size stays a list", function()
    local s = tensor.zeros(2, 3, 4):size()
    assert.are.equal(3, #s)
    assert.are.equal("table", type(s))
    assert.are.equal(0, #tensor.tensor(5):size())
    assert.are.equal(1, #tensor.zeros(0):size())
    assert.are.equal(3, s[2])
    local dims = {}
    for i, d in ipairs(s) do dims[i] = d end
    assert.are.same({2, 3, 4}, dims)
    assert.are.same({2, 3, 4}, {unpack(s)})
    assert.are.equal(24, s:numel())
    assert.are.equal("Size([2, 3, 4])", tostring(s))
    assert.are.equal(s, tensor.ones(2, 3, 4).shape)
    assert.are_not.equal(s, tensor.ones(2, 3).shape)
    assert.are.equal(3, #tensor.zeros(s):size())
    assert.are.equal(s, tensor.ones(s):size())
    assert.are.equal(s, tensor.full(s, 2):size())
    assert.are.equal(s, tensor.zeros(24):view(s):size())
  end)

  it("after a trip through the codec: the same class, count, fields and Size", function()
    local ds = D.TensorDataset(tensor.arange(1, 11))
    local loader = roundtrip(D.DataLoader(ds, {batch_size = 3, drop_last = true}))
    assert.are.equal(3, #loader)
    assert.are.equal(10, #loader.dataset)
    assert.are.equal(D.DataLoader, getmetatable(loader))
    local s = roundtrip(dist.DistributedSampler(10, {rank = 2, world_size = 3, seed = 7}))
    local here = dist.DistributedSampler(10, {rank = 2, world_size = 3, seed = 7})
    assert.are.equal(4, #s)
    assert.are.same(here:indices(), s:indices())
    local parts = roundtrip(D.random_split(ds, {4, 6}, {seed = 2}))
    assert.are.equal(4, #parts[1])
    assert.are.equal(6, #parts[2])
    assert.are.equal(10, #roundtrip(D.RandomSampler(10, {seed = 1})))
    local seq = roundtrip(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert.are.equal(2, #seq)
    assert.is_true(nn.is_module(seq))
    local size = roundtrip(tensor.zeros(5, 6):size())
    assert.are.equal(2, #size)
    assert.are.equal("Size([5, 6])", tostring(size))
  end)
end)

describe("sized objects over rpc #world", function()
  it("arrive as objects of their class that # counts, and come back so", function()
    local r = S.world(2, S.prelude .. [[
      local tensor, nn = require "tensor", require "nn"
      local D = tensor.data
      function counts(loader, sampler, seq, size)
        return #loader, #loader.dataset, #sampler, #seq, #size, seq(tensor.ones(1, 2)):size(), sampler
      end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local ds = D.TensorDataset(tensor.arange(1, 11))
        local sampler = dist.DistributedSampler(10, {rank = 1, world_size = 3, drop_last = true})
        local seq = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        local nb, nd, ns, nm, nz, out, back = rpc.rpc_sync("worker1", counts,
          {D.DataLoader(ds, {batch_size = 4}), sampler, seq, tensor.zeros(2, 3):size()})
        check("counted there", nb == 3 and nd == 10 and ns == 3 and nm == 3 and nz == 2,
          table.concat({nb, nd, ns, nm, nz}, ","))
        check("a Size back", tostring(out) == "Size([1, 1])" and #out == 2, out)
        check("a sampler back", #back == 3 and table.concat(back:indices(), ",") == table.concat(sampler:indices(), ","))
        local rm = rpc.RemoteModule("worker1", nn.Sequential, {nn.Linear(2, 3), nn.ReLU()})
        check("a remote Sequential", tostring(rm:forward(tensor.ones(1, 2)):size()) == "Size([1, 3])"
          and #rm:remote_parameters() == 2)
      end
      rpc.shutdown()
    ]], {timeout = 60})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)
end)
