-- dist.checkpoint: a world's checkpoint (PyTorch's distributed checkpoint):
-- replicated tensors written once, shards by their owners, rank 0 committing
-- the metadata last; loads fill a state_dict in place and re-shard to another
-- world size; a rank killed during a save leaves the previous checkpoint as
-- the one that loads.
local S = require "spec.support"
local core = require "rpchost.core"

local HEAD = S.prelude .. [[
  local dist = require "dist"
  local tensor = require "tensor"
  dist.init_process_group{backend = "gloo"}
  local r, n = dist.get_rank(), dist.get_world_size()
  local dir = os.getenv("CKDIR")
  -- generation g's state: a replicated weight, a row-sharded optimizer state
  local function W(g) return tensor.arange(8 * 6):float():view(8, 6) + g * 1000 end
  local function state(g, rows_here, first_row, like)
    return {model = {weight = like and tensor.zeros(8, 6) or W(g), bias = like and tensor.zeros(6) or tensor.ones(6) * g},
            step = not like and g or nil,
            opt = {exp_avg = dist.checkpoint.Shard{
              tensor = like and tensor.zeros(rows_here, 6) or W(g):narrow(1, first_row + 1, rows_here) * 10,
              offsets = {first_row, 0}, size = {8, 6}}}}
  end
  local rows = 8 / n
]]

local function world(n, body, dir, extra)
  return S.world(n, HEAD .. body, {timeout = 120, env = {CKDIR = dir}})
end

describe("dist.checkpoint #world", function()
  for _, sizes in ipairs({{2, 4}, {4, 2}, {2, 2}}) do
    it(("saves in a world of %d and loads, re-sharded, in a world of %d"):format(sizes[1], sizes[2]), function()
      local dir = S.tmpdir .. "/dcp_" .. sizes[1] .. "_" .. sizes[2]
      os.execute("rm -rf " .. dir)
      local r = world(sizes[1], [[
        dist.checkpoint.save(state(3, rows, r * rows), dir)
        local files = 0
        for name in io.popen("ls -a " .. dir):lines() do if name:match("distcp$") then files = files + 1 end end
        check("one data file per rank", files == n, files)
        dist.destroy_process_group()
      ]], dir)
      assert.are.equal(0, r.status, r.out .. r.err)
      S.assert_checks(r)
      r = world(sizes[2], [[
        local sd = state(0, rows, r * rows, true)
        dist.checkpoint.load(sd, dir)
        check("replicated tensors", sd.model.weight:equal(W(3)) and sd.model.bias:equal(tensor.ones(6) * 3))
        check("plain values", sd.step == 3)
        check("this rank's shard, re-sharded", sd.opt.exp_avg.tensor:equal(W(3):narrow(1, r * rows + 1, rows) * 10))
        local whole = {opt = {exp_avg = tensor.zeros(8, 6)}}
        dist.checkpoint.load(whole, dir)
        check("a sharded tensor loaded whole", whole.opt.exp_avg:equal(W(3) * 10))
        local ok, e = pcall(dist.checkpoint.load, {model = {weight = tensor.zeros(3, 3)}}, dir)
        check("a shape that differs is named", not ok and tostring(e.message):find("model.weight has shape [8, 6]", 1, true), e)
        dist.destroy_process_group()
      ]], dir)
      assert.are.equal(0, r.status, r.out .. r.err)
      S.assert_checks(r)
    end)
  end

  it("keeps the previous checkpoint when a rank is killed during a save", function()
    local dir = S.tmpdir .. "/dcp_killed"
    local gens = {}
    for round = 1, 6 do
      os.execute("rm -rf " .. dir)
      local r = world(2, [[
        dist.checkpoint.save(state(1, rows, r * rows), dir)
        dist.destroy_process_group()
      ]], dir)
      assert.are.equal(0, r.status, r.out .. r.err)
      -- generation 2 onwards, saved again and again with big tensors, until a rank is killed
      local port = S.free_port()
      local script = S.write(HEAD:gsub("dist.init_process_group{backend = \"gloo\"}",
        "dist.init_process_group{backend = \"gloo\", timeout = 10}") .. [[
        local big = tensor.ones(1048576)
        for g = 2, 1000 do
          local sd = state(g, rows, r * rows)
          sd.big = big * g
          dist.checkpoint.save(sd, dir)
        end
      ]])
      local hs = {}
      for rank = 0, 1 do
        hs[rank] = S.start({script}, {env = {CKDIR = dir, RANK = rank, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1",
                                             MASTER_PORT = port}})
      end
      require("rpchost.sched").sleep(0.3 + (round % 3) * 0.35)
      hs[round % 2]:kill(core.SIGKILL)
      for rank = 0, 1 do hs[rank]:kill(core.SIGKILL); hs[rank]:wait(20) end
      r = world(2, [[
        local sd = state(0, rows, r * rows, true)
        sd.big = tensor.zeros(1048576)
        dist.checkpoint.load(sd, dir)
        local g = sd.step
        print("generation " .. tostring(g))
        check("a whole generation", type(g) == "number" and sd.model.weight:equal(W(g))
          and sd.opt.exp_avg.tensor:equal(W(g):narrow(1, r * rows + 1, rows) * 10)
          and (g == 1 or sd.big:equal(tensor.ones(1048576) * g)), g)
        dist.destroy_process_group()
      ]], dir)
      assert.are.equal(0, r.status, "round " .. round .. ": " .. r.out .. r.err)
      gens[#gens + 1] = r.out:match("generation (%d+)")
      -- a save after the kill leaves only its own files
      r = world(2, [[
        dist.checkpoint.save(state(99, rows, r * rows), dir)
        local names = {}
        for name in io.popen("ls -a " .. dir):lines() do
          if name ~= "." and name ~= ".." then names[#names + 1] = name end
        end
        check("only the new save's files", #names == n + 1, table.concat(names, " "))
        dist.destroy_process_group()
      ]], dir)
      assert.are.equal(0, r.status, r.out .. r.err)
      S.assert_checks(r)
      S.assert_checks(r)
    end
    -- (the kills landed while saves were going on: later generations were committed)
    local later = 0
    for _, g in ipairs(gens) do if tonumber(g) > 2 then later = later + 1 end end
    assert.is_true(later >= 3, "generations seen: " .. table.concat(gens, ", "))
  end)
end)
