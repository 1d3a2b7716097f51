-- rpchost.tools.repl: `rpchost repl`, an interactive member of a world.
--
--   rpchost repl                                   a one-rank local world
--   rpchost repl --master-addr A --master-port P [--name N] [--token T] [--timeout S]
--                                                  join the world running there
--
-- Input never blocks the loop (l_repl.c), so the world can call this member while
-- it waits for a line. Each complete chunk runs as its own task: Ctrl-C
-- interrupts the call it is waiting on, cancels the calls it left waiting (their
-- callees stop them too) and returns to the prompt. `=expr` and bare
-- expressions print their values (tables nested, cycles marked; tensors, Futures,
-- RRefs and WorkerInfo as themselves). Tab completes globals, fields (an
-- object's own and its class's, a tensor's and an RRef's methods) and worker
-- names; history is kept in ~/.rpchost_history. Ctrl-D or os.exit() leave the
-- world cleanly. Errors show the user's frames, not the REPL's. When the world
-- it joined stops, the REPL says so. Joining says at once where, and gives up
-- after --timeout.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local report = require "rpchost.tools.report"
local errors = require "rpchost.errors"
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
-- tensor's methods and properties (its __index is a function). Metamethods
-- (`__index`, `__gc`) are never offered. One of rpchost's runtime objects (an
-- RRef, a Future, a WorkerInfo: a value with a wire form of its own) offers its
-- public API only: its class's methods and the fields its documentation names
-- (PUBLIC_FIELDS), not the bookkeeping it carries (an RRef's creation,
-- sentinel, fork). Other objects (an nn.Linear, the user's) offer their fields.
local PUBLIC_FIELDS = {
  [require "rpchost.wire.workerinfo"] = {"id", "name"},
  [errors.Error] = {"kind", "message", "worker", "rank", "traceback"},
}

-- A method: a function whose first parameter is self (`function C:m()`), not
-- a constructor or a helper the class also holds (`Future.new`, `WorkerInfo.is`).
local function is_method(f)
  return type(f) == "function" and debug.getlocal(f, 1) == "self"
end

local function names_of(v)
  local out, seen = {}, {}
  local function add(t, only)
    for k, x in pairs(t) do
      if type(k) == "string" and not seen[k] and k:sub(1, 2) ~= "__" and (not only or only(k, x)) then
        seen[k] = true
        out[#out + 1] = k
      end
    end
  end
  local tensor = package.loaded["rpchost.tensor"]
  if tensor and tensor.is_tensor and tensor.is_tensor(v) then
    add(tensor.methods)
    add(tensor.props)
  end
  local mt = getmetatable(v)
  -- (an object's names that start with '_' are its own business; a plain
  -- table's, a module's such as rpc._set_rpc_timeout, are offered)
  local public = type(mt) == "table" and function(k) return k:sub(1, 1) ~= "_" end or nil
  local runtime = require("rpchost.wire.codec").has_extension(mt)
  local own = sized.raw(v) -- (a sized object's fields are the table behind it)
  if type(own) == "table" then
    if runtime then
      for _, k in ipairs(PUBLIC_FIELDS[mt] or {}) do add({[k] = true}) end
    else
      add(own, public)
    end
  end
  -- the classes: an __index table is the class; a class whose __index is a
  -- function (an nn module's, which finds parameters) holds its methods itself
  local methods = runtime and function(k, x) return k:sub(1, 1) ~= "_" and is_method(x) end or public
  local cls, hops = mt, 0
  while type(cls) == "table" and hops < 16 do
    local idx = rawget(cls, "__index")
    local class = type(idx) == "table" and idx or type(idx) == "function" and cls or nil
    if not class then break end
    add(class, methods)
    local up = getmetatable(class)
    if up == cls then break end
    cls, hops = up, hops + 1
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
    if sep == ":" then
      -- (`v:` calls a method: only functions follow it)
      local methods = {}
      for _, k in ipairs(names) do
        local ok, x = pcall(function() return t[k] end)
        if ok and type(x) == "function" then methods[#methods + 1] = k end
      end
      names = methods
    end
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
-- the line, the scheduler under it) are not the user's code and go; rpchost's
-- other frames are folded (rpchost.errors.traceback), a remote error's too.
local OWN_FRAMES = {"rpchost/tools/repl%.lua:", "rpchost/sched%.lua:", "^%s*%[C%]: in function 'xpcall'$",
                    "^%s*%[C%]: in function 'pcall'$"}
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
  -- (the frames that ran the line, folded at the end, are the REPL's too; and
  -- a traceback left with no frame says nothing)
  if kept[#kept] and kept[#kept]:match("^%s*%.%.%. %d+ rpchost frames?$") then kept[#kept] = nil end
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

-- Why the world this member joined has stopped, or nil while it runs
-- (rpchost.tools.introspect.world_stopped).
M.world_stopped = function(a) return require("rpchost.tools.introspect").world_stopped(a) end

-- Ctrl-C ------------------------------------------------------------------------------------
local function agent()
  local rpc = package.loaded["rpchost.rpc"]
  return rpc and rpc._agent and rpc._agent()
end

-- An interrupted line's calls still waiting for replies (those numbered after
-- first_id) are cancelled: they fail here, and each callee drops the request,
-- or stops the function where it next waits (rpchost.rpc.callee.cancel_request)
-- instead of running on for nobody. Returns what to add to "interrupted".
function M.cancel_calls(a, first_id)
  if not (a and first_id and a.pending) then return "" end
  local caller = require "rpchost.rpc.caller"
  local ids = {}
  for id in pairs(a.pending) do
    if id > first_id and id <= a.next_id then ids[#ids + 1] = id end
  end
  table.sort(ids)
  local done = {}
  for _, id in ipairs(ids) do
    local to, what = caller.cancel(a, id, "the REPL line that made it was interrupted (Ctrl-C)")
    if to then done[#done + 1] = ("%s on %s"):format(what, to) end
  end
  if #done == 0 then return "" end
  local shown = table.concat(done, ", ", 1, math.min(#done, 3))
  if #done > 3 then shown = shown .. (", and %d more"):format(#done - 3) end
  return ("; cancelled %d call%s it was waiting on: %s (a callee stops a running call at its next wait)"):format(
    #done, #done == 1 and "" or "s", shown)
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
        local a = agent()
        local first_id = a and a.next_id -- (the calls this line makes are numbered after it)
        running = sched.spawn(function()
          sched.current().entry = f -- (named in a traceback when `=expr` tail-calls what failed)
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
        elseif tostring(result[2]):match("^interrupted") then
          io.stdout:write("interrupted", M.cancel_calls(a, first_id), "\n")
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

local USAGE = [[
usage: rpchost repl [--master-addr A --master-port P] [--name NAME] [--token T] [--timeout S]

Without an address: a one-rank local world. With one: joins the world whose
store is at A:P (default 127.0.0.1 and $MASTER_PORT or 29500) as NAME (default
repl-<pid>), waiting up to S seconds for it (default 10, or
$RPCHOST_INIT_TIMEOUT). Ctrl-C interrupts the line being run and cancels the
calls it left waiting; Ctrl-D leaves the world.
]]

function M.main(argv)
  local o = {}
  local i = 1
  while argv[i] do
    local a = argv[i]
    local takes = {["--master-addr"] = "addr", ["--master-port"] = "port", ["--name"] = "name", ["--token"] = "token",
                   ["--timeout"] = "timeout"}
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
      if a == "--timeout" and not (tonumber(v) and tonumber(v) > 0) then
        io.stderr:write("rpchost repl: --timeout must be a number of seconds above 0, got '", v, "'\n")
        return 2
      end
      o[takes[a]] = v
      i = i + 2
    elseif a == "-h" or a == "--help" then
      io.stdout:write(USAGE)
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
      local where = ("%s:%s"):format(o.addr or "127.0.0.1", o.port or os.getenv("MASTER_PORT") or "29500")
      o.name = o.name or ("repl-" .. core.getpid())
      -- (said at once: a wrong address shows itself in seconds, not after a
      -- training job's 300 s of init_timeout)
      local wait = tonumber(o.timeout) or tonumber(os.getenv("RPCHOST_INIT_TIMEOUT")) or 10
      io.stdout:write(("joining the world at %s as %s (waiting up to %g s for it; --timeout S changes that)...\n"):format(
        where, o.name, wait))
      io.stdout:flush()
      rpc.init_rpc(o.name, {rpc_backend_options = rpc.TensorPipeRpcBackendOptions{init_method = "tcp://" .. where,
        init_timeout = wait}})
      io.stdout:write(("joined the world at %s as %s (rank %d); Ctrl-D leaves\n"):format(where, o.name,
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
    -- (an error object says what to do; a traceback is for bugs)
    io.stderr:write("rpchost repl: ", require("rpchost.errors").is(err) and tostring(err) or report.format_error(err),
      "\n")
    return 1
  end
  return 0
end

return M
