-- rpchost.tools.repl: `rpchost repl`, an interactive member of a world.
--
--   rpchost repl                                   a one-rank local world
--   rpchost repl --master-addr A --master-port P [--name N] [--token T]
--                                                  join the world running there
--
-- Input never blocks the loop (l_repl.c), so the world can call this member while
-- it waits for a line. Each complete chunk runs as its own task: Ctrl-C
-- interrupts the call it is waiting on and returns to the prompt. `=expr` and bare
-- expressions print their values (tables nested, cycles marked; tensors, Futures,
-- RRefs and WorkerInfo as themselves). Tab completes globals, fields (an
-- object's own and its class's, a tensor's and an RRef's methods) and worker
-- names; history is kept in ~/.rpchost_history. Ctrl-D or os.exit() leave the
-- world cleanly. Errors show the user's frames, not the REPL's. When the world
-- it joined stops, the REPL says so.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local report = require "rpchost.tools.report"
local sized = require "rpchost.sized"

local M = {}

-- pretty printing ----------------------------------------------------------------------
local function is_ident(k) return type(k) == "string" and k:match("^[%a_][%w_]*$") ~= nil end

function M.pretty(v, indent, seen, depth)
  indent, seen, depth = indent or "", seen or {}, depth or 0
  if type(v) == "string" then return ("%q"):format(v) end
  v = sized.raw(v) -- (a sized object, a DataLoader or a sampler, shows as the table behind it)
  if type(v) ~= "table" or getmetatable(v) and getmetatable(v).__tostring then return tostring(v) end
  if seen[v] then return "<cycle>" end
  if depth >= 4 then return "{...}" end
  seen[v] = true
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b)
    local ta, tb = type(a), type(b)
    if ta ~= tb then return ta < tb end
    if ta == "number" or ta == "string" then return a < b end
    return tostring(a) < tostring(b)
  end)
  if #keys == 0 then seen[v] = nil return "{}" end
  local parts, inner = {}, indent .. "  "
  for i, k in ipairs(keys) do
    if i > 50 then parts[#parts + 1] = inner .. ("... (%d more)"):format(#keys - 50) break end
    local ks
    if type(k) == "number" and k == i then ks = ""
    elseif is_ident(k) then ks = k .. " = "
    else ks = "[" .. M.pretty(k, inner, seen, depth + 1) .. "] = " end
    parts[#parts + 1] = inner .. ks .. M.pretty(v[k], inner, seen, depth + 1)
  end
  seen[v] = nil
  return "{\n" .. table.concat(parts, ",\n") .. "\n" .. indent .. "}"
end

-- completion -----------------------------------------------------------------------------
-- The names that may follow `v.` or `v:`: its own fields, those its metatables'
-- __index tables give it (an instance's class and the classes above), a
-- tensor's methods and properties (its __index is a function).
local function names_of(v)
  local out, seen = {}, {}
  local function add(t)
    for k in pairs(t) do
      if type(k) == "string" and not seen[k] then seen[k] = true; out[#out + 1] = k end
    end
  end
  local own = sized.raw(v)
  if type(own) == "table" then add(own) end
  local tensor = package.loaded["rpchost.tensor"]
  if tensor and tensor.is_tensor and tensor.is_tensor(v) then
    add(tensor.methods)
    add(tensor.props)
  end
  local mt, hops = getmetatable(v), 0
  while type(mt) == "table" and hops < 16 do
    local idx = rawget(mt, "__index")
    if type(idx) ~= "table" then break end
    add(idx)
    mt, hops = getmetatable(idx), hops + 1
  end
  return out
end
M.names_of = names_of

local function complete(text)
  local out = {}
  local base, sep, partial = text:match("^(.*)([%.:])([%w_]*)$")
  local names
  if base then
    local t = _G
    for part in base:gmatch("[^%.:]+") do
      if type(t) ~= "table" and type(t) ~= "userdata" then return out end
      local ok, v = pcall(function() return t[part] end)
      if not ok then return out end
      t = v
    end
    names = names_of(t)
  else
    partial, base, sep = text, nil, nil
    names = names_of(_G)
  end
  for _, k in ipairs(names) do
    if k:sub(1, #partial) == partial then
      out[#out + 1] = base and (base .. sep .. k) or k
    end
  end
  if not base then
    local rpc = package.loaded["rpchost.rpc"]
    local a = rpc and rpc._agent and rpc._agent()
    if a then
      for _, p in pairs(a.peers) do
        if p.name:sub(1, #partial) == partial then out[#out + 1] = p.name end
      end
    end
  end
  table.sort(out)
  return out
end
M.complete = complete

-- errors -------------------------------------------------------------------------------------
-- An error as the user should see it: the REPL's own frames (the task that ran
-- the line, the scheduler under it) are not the user's code and go.
local OWN_FRAMES = {"rpchost/tools/repl%.lua:", "rpchost/sched%.lua:", "^%s*%[C%]: in function 'xpcall'$",
                    "^%s*%[C%]: in function 'pcall'$", "^%s*%(tail call%)"}
function M.error_text(e)
  local text = report.format_error(e)
  local kept = {}
  for line in (text .. "\n"):gmatch("(.-)\n") do
    local own = false
    for _, pat in ipairs(OWN_FRAMES) do
      if line:find(pat) then own = true break end
    end
    if not own then kept[#kept + 1] = line end
  end
  -- (a traceback left with no frame says nothing)
  if kept[#kept] and kept[#kept]:match("^%s*stack traceback:%s*$") then kept[#kept] = nil end
  return table.concat(kept, "\n")
end

-- A message shown while the user may be typing: on its own line, then a fresh
-- prompt (the line editor starts over, as after Ctrl-C).
local function announce(text)
  io.stdout:write("\n", text, "\n")
  io.stdout:flush()
  core.repl_reset("> ")
end
M.announce = announce

-- Why the world this member joined has stopped, or nil while it runs: every
-- static rank shut down, or its store is gone.
function M.world_stopped(a)
  if not a or a.state ~= "running" or not a.store then return nil end
  local keys = {}
  for r = 0, a.world_size - 1 do keys[#keys + 1] = a.prefix .. "shutdown/" .. r end
  local ok, got = pcall(a.store.multi_get, a.store, keys)
  if not ok then
    return ("its store at %s is gone (%s)"):format(tostring(a.store.addr), tostring(type(got) == "table"
      and got.message or got))
  end
  for i = 1, #keys do if not got[i] then return nil end end
  return ("all %d of its ranks shut down"):format(a.world_size)
end

-- the loop ---------------------------------------------------------------------------------
local function print_results(r)
  if r.n == 0 then return end
  local out = {}
  for i = 1, r.n do out[i] = M.pretty(r[i]) end
  io.stdout:write(table.concat(out, "\t"), "\n")
end

local function compile(chunk)
  local src = chunk
  if src:sub(1, 1) == "=" then src = "return " .. src:sub(2) end
  local f = loadstring("return " .. src, "=stdin")
  if f then return f end
  local err
  f, err = loadstring(src, "=stdin")
  if f then return f end
  if err and err:match("<eof>") then return nil, "incomplete" end
  return nil, err
end

function M.loop(leave)
  local lines, waiting_task, eof = {}, nil, false
  local hist = (os.getenv("HOME") or "/tmp") .. "/.rpchost_history"
  local arm
  core.repl_start("> ", function(line)
    if line == nil then eof = true else lines[#lines + 1] = line end
    if waiting_task then sched.wake(waiting_task) end
    arm()
  end, complete, hist)
  local running = nil
  local sig
  local chunk = nil
  -- libedit puts back the SIGINT handler it found whenever it leaves a line, so the
  -- watcher is armed again after every line (libuv installs its handler on start)
  arm = function()
    if sig then sig:close() end
    sig = core.signal(core.SIGINT, function()
      if running and sched.interrupt(running, "interrupted") then return end
      io.stdout:write("\n")
      lines, M.pending, chunk = {}, nil, nil -- (an unfinished chunk goes too)
      core.repl_reset("> ")
      arm()
    end)
  end
  arm()
  while true do
    while #lines == 0 and not eof do
      waiting_task = sched.current()
      sched.suspend("a line of input")
      waiting_task = nil
    end
    if #lines == 0 and eof then break end
    local line = table.remove(lines, 1)
    chunk = chunk and (chunk .. "\n" .. line) or line
    local f, err = compile(chunk)
    if err == "incomplete" then
      core.repl_prompt(">> ")
    else
      chunk = nil
      if not f then
        io.stderr:write(tostring(err), "\n")
      else
        local done = false
        local result
        running = sched.spawn(function()
          result = table.pack(xpcall(f, sched.traceback))
          done = true
          if waiting_task then sched.wake(waiting_task) end
        end, {name = "repl line", on_error = function() end})
        while not done do
          waiting_task = sched.current()
          sched.suspend("the line being run")
          waiting_task = nil
        end
        running = nil
        if result[1] then print_results(table.pack(unpack(result, 2, result.n)))
        elseif tostring(result[2]):match("^interrupted") then io.stdout:write("interrupted\n")
        else io.stderr:write(M.error_text(result[2]), "\n") end
      end
      core.repl_reset("> ")
    end
  end
  sig:close()
  core.repl_stop(hist)
  io.stdout:write("\n")
  leave()
end

function M.main(argv)
  local o = {}
  local i = 1
  while argv[i] do
    local a = argv[i]
    local takes = {["--master-addr"] = "addr", ["--master-port"] = "port", ["--name"] = "name", ["--token"] = "token"}
    if takes[a] then
      local v = argv[i + 1]
      if v == nil or v:sub(1, 2) == "--" then
        io.stderr:write("rpchost repl: ", a, " needs a value (rpchost repl --help)\n")
        return 2
      end
      if a == "--master-port" and not tonumber(v) then
        io.stderr:write("rpchost repl: --master-port must be a port number, got '", v, "'\n")
        return 2
      end
      o[takes[a]] = v
      i = i + 2
    elseif a == "-h" or a == "--help" then
      io.stdout:write("usage: rpchost repl [--master-addr A --master-port P] [--name NAME] [--token T]\n")
      return 0
    else
      io.stderr:write("rpchost repl: unknown option ", a, "\n")
      return 2
    end
  end
  if o.token then core.setenv("RPCHOST_TOKEN", o.token) end
  for _, k in ipairs({"RANK", "WORLD_SIZE", "LOCAL_RANK"}) do core.setenv(k, nil) end
  require("rpchost.env").detach() -- (a member by address, even under srun or in a batch script)
  local ok, err = sched.run(function()
    local rpc = require "rpc"
    for _, m in ipairs({"rpc", "dist", "tensor", "nn", "optim", "dist_autograd"}) do _G[m] = require(m) end
    if o.addr or o.port then
      local init = ("tcp://%s:%s"):format(o.addr or "127.0.0.1", o.port or os.getenv("MASTER_PORT") or "29500")
      o.name = o.name or ("repl-" .. core.getpid())
      rpc.init_rpc(o.name, {rpc_backend_options = rpc.TensorPipeRpcBackendOptions{init_method = init}})
      io.stdout:write(("joined the world at %s as %s (rank %d); Ctrl-D leaves\n"):format(init:sub(7), o.name,
        rpc.get_worker_info().id))
    else
      local l = core.listen("127.0.0.1", 0, {accept = function(c) c:close() end})
      local p = l:port()
      l:close()
      rpc.init_rpc(o.name or "repl", {rank = 0, world_size = 1, rpc_backend_options =
        rpc.TensorPipeRpcBackendOptions{init_method = ("tcp://127.0.0.1:%d"):format(p)}})
    end
    io.stdout:write(report.version_string(), "\n")
    local left = false
    local function leave()
      if left then return end
      left = true
      pcall(rpc.shutdown)
    end
    -- os.exit() leaves the world first
    local raw_exit = os.exit
    os.exit = function(...) leave() return raw_exit(...) end
    if o.addr or o.port then
      -- tell the user when the world stops under them (calls into it fail from then)
      sched.spawn(function()
        while not left do
          sched.sleep(tonumber(os.getenv("RPCHOST_REPL_WATCH")) or 1)
          local why = not left and M.world_stopped(rpc._agent())
          if why then
            announce(("the world this REPL joined has stopped: %s; calls to it will fail (Ctrl-D leaves)"):format(why))
            return
          end
        end
      end, {name = "repl world watch", on_error = function() end})
    end
    M.loop(leave)
  end, "repl")
  if not ok then
    io.stderr:write("rpchost repl: ", report.format_error(err), "\n")
    return 1
  end
  return 0
end

return M
