-- rpchost.tools.cli: the command line. `rpchost run ...` is the launcher, `rpchost repl`
-- joins a world interactively, and everything else behaves like `luajit`
-- (-e, -l, -i, -v, -, the `arg` table, exit codes, errors with tracebacks), so
-- that `busted --lua=rpchost` runs specs inside the host. Whatever runs does so
-- as the main task of the scheduler, so it may make blocking calls.
do -- (the rest of the library loads from compiled bytecode: rpchost.bytecode)
  local here = package.searchpath("rpchost.tools.cli", package.path)
  require("rpchost.bytecode").install(here and here:match("^(.*)/rpchost/tools/cli%.lua$"))
end
-- Code must run 1,000 times (LuaJIT's default: 56) before it is compiled. Most
-- of rpchost's Lua is glue between C calls (tensor ops, the codec, the rings),
-- which is branchy: at 56 a training program compiled hundreds of traces in
-- its first seconds (the batch parameter server's trainer: 412 traces and 150
-- aborted ones in 200 batches), and that compiling cost more than the traces
-- saved (60 batches: 2.87 -> 2.47 ms a batch; the pipeline tutorial ~5%
-- faster). Loops that really are hot pass 1,000 within milliseconds and run
-- as fast as before (bench/model_ops.lua's MLP loop within 1%, rpc_sync and
-- barrier latency unchanged). A script may set its own: jit.opt.start("hotloop=56").
-- (a LuaJIT built without the JIT has no jit.opt: nothing to set there)
-- And up to 16 MB of machine code, not LuaJIT's default 512 KB: a rank of two
-- that made RPCs and a few thousand small collectives had 200 traces live and
-- ran out of it, and LuaJIT then throws every trace away and compiles again
-- from nothing, interpreted meanwhile (the same loop of barriers: 1.07 -> 0.90
-- us, medians of 6 alternated runs; bench/README.md). The code is mapped in
-- pieces as it is made, so a program that compiles less pays nothing.
if jit.opt then pcall(jit.opt.start, "hotloop=1000", "maxmcode=16384") end
require("rpchost.tools.priority").adopt() -- (a rank of a launcher that raised its own priority)
require "rpchost.compat"
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"
local report_mod = require "rpchost.tools.report"

local M = {}

local USAGE = [==[
usage: rpchost [options] [script [args...]]     run a script (one rank), like luajit
       rpchost run  --nproc-per-node N [--nnodes M --node-rank K --master-addr A
                    --master-port P | --standalone] [--prefix] [--grace S]
                    [--max-restarts N] script [args...]
                                                start a world of N ranks per node
       rpchost repl [--master-addr A --master-port P] [--name NAME] [--token T]
                                                join a running world interactively
       rpchost top  [--master-addr A --master-port P] [--token T] [--interval S]
                    [--timeout S] [--name NAME] [--once] [--wait]
                                                watch a running world live (q quits)
       rpchost plot LOGDIR [-o FILE] [--smoothing W] [--title TEXT]
                                                draw a SummaryWriter's curves as HTML

Subcommands: run, repl, top, plot (each takes --help).

Interpreter options (as luajit):
  -e chunk   run the string 'chunk'
  -l name    require library 'name' into the global 'name'
  -i         enter interactive mode after running the script
  -v         show version information
  -          run stdin as the script and stop handling options
  --         stop handling options
  -h, --help show this help

Modules: rpc, dist, tensor, dist_autograd, nn, optim.
Environment: RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
             RPCHOST_TOKEN RPCHOST_LOG=debug|info|warn RPCHOST_INIT_TIMEOUT (seconds)
             and more: docs/environment.md; under srun, nothing: docs/slurm.md
Documentation: man rpchost; README.md and docs/ (docs/README.md: the index) in
             %s
]==]

-- Where README.md and docs/ are: beside an installed binary (<prefix>/share/doc/
-- rpchost), else the source tree whose Lua library this binary uses.
function M.docs_dir()
  local here = package.searchpath("rpchost.tools.cli", package.path) or ""
  local lua_dir = here:match("^(.*)/rpchost/tools/cli%.lua$") or ""
  local prefix = lua_dir:match("^(.*)/share/rpchost/lua/?$")
  if prefix then return prefix:gsub("/[^/]+/%.%.$", "") .. "/share/doc/rpchost" end
  return lua_dir:match("^(.*)/lua/?$") or "."
end

function M.usage() return USAGE:format(M.docs_dir()) end

M.version_string = report_mod.version_string
M.format_error = report_mod.format_error

-- An error that ended the script: said once, the user's part of it (a config
-- error in one line at the user's line; a runtime error with the user's
-- frames: rpchost.tools.report), in one write, so that ranks sharing a
-- terminal cannot tear it apart.
local function report(e)
  local text = report_mod.script_error(e)
  io.stderr:write("rpchost: " .. text .. "\n")
  io.stderr:flush()
  local path = os.getenv("RPCHOST_ERROR_FILE")
  if path and path ~= "" then
    -- (whole or not at all: the launcher reads it once this rank is gone)
    local ok, err = pcall(require("rpchost.atomic_file").save, path, text .. "\n", {who = "RPCHOST_ERROR_FILE"})
    if not ok then io.stderr:write("rpchost: ", tostring(err), "\n") end
  end
end

local function incomplete(err)
  return err and err:match("<eof>") ~= nil
end

-- A plain line REPL: `=expr` and bare expressions print their values.
function M.interactive()
  io.stdout:write(M.version_string(), "\n")
  while true do
    io.stdout:write("> ")
    io.stdout:flush()
    local line = io.stdin:read("*l")
    if not line then io.stdout:write("\n") break end
    local chunk = line
    if chunk:sub(1, 1) == "=" then chunk = "return " .. chunk:sub(2) end
    local f, err = loadstring("return " .. chunk, "=stdin")
    if not f then
      f, err = loadstring(chunk, "=stdin")
      while not f and incomplete(err) do
        io.stdout:write(">> ")
        io.stdout:flush()
        local more = io.stdin:read("*l")
        if not more then break end
        chunk = chunk .. "\n" .. more
        f, err = loadstring(chunk, "=stdin")
      end
    end
    if not f then
      io.stderr:write(tostring(err), "\n")
    else
      local r = {n = 0}
      local function collect(ok, ...)
        r = {n = select("#", ...), ok = ok, ...}
      end
      collect(xpcall(f, sched.traceback))
      if not r.ok then
        io.stderr:write(M.format_error(r[1]), "\n")
      elseif r.n > 0 then
        local out = {}
        for i = 1, r.n do out[i] = tostring(r[i]) end
        io.stdout:write(table.concat(out, "\t"), "\n")
      end
    end
  end
end

-- A rank that srun started takes its share of the host's cores, as one of
-- `rpchost run` does (host/tensor/parallel.c reads LOCAL_WORLD_SIZE itself;
-- Slurm's count of this node's tasks is read by rpchost.env), or the CPUs
-- srun -c gave it. (A malformed variable is said when init reads it.)
local function share_of_host()
  local ok, info = pcall(require("rpchost.env").info)
  -- (a binary older than this library has no hint to take)
  if ok and info.source == "slurm" and core.parallel_hint then
    core.parallel_hint(info.local_world_size or 0, info.cpus_per_task or 0)
  end
end

local function interpreter(argv)
  local i, actions, interactive, version = 1, {}, false, false
  local script
  while argv[i] do
    local o = argv[i]
    if o == "--" then i = i + 1; break
    elseif o == "-" then script = "-"; break
    elseif o == "-h" or o == "--help" then io.stdout:write(M.usage()); return 0
    elseif o == "-i" then interactive = true; version = true; i = i + 1
    elseif o == "-v" then version = true; i = i + 1
    elseif o == "-e" or o == "-l" then
      if not argv[i + 1] then
        io.stderr:write("rpchost: '", o, "' needs an argument\n", M.usage())
        return 1
      end
      actions[#actions + 1] = {o, argv[i + 1]}
      i = i + 2
    elseif o:match("^%-[el].") then
      actions[#actions + 1] = {o:sub(1, 2), o:sub(3)}
      i = i + 1
    elseif o:sub(1, 1) == "-" then
      io.stderr:write("rpchost: unrecognized option '", o, "'\n", M.usage())
      return 1
    else break end
  end
  script = script or argv[i]
  -- the arg table: arg[0] is the script, negative indices the interpreter and options
  local arg = {}
  for j = 0, #argv do arg[j - i] = argv[j] end
  _G.arg = arg

  -- A script stopped by SIGINT/SIGTERM (Ctrl-C, the launcher stopping the
  -- world) still writes its trace and removes its socket files, then exits as
  -- the signal would (128 + n). (Ctrl-C reaches a rank twice, from the terminal
  -- and from its launcher: the second must not cut the first one's cleanup
  -- short, so the watchers stay. A rank stuck in a long computation handles it
  -- when that returns; the launcher's SIGKILL after its grace period is the
  -- backstop.)
  local stop_watchers -- (kept while the script runs)
  local function on_stop_signals()
    local watchers = {}
    for _, name in ipairs({"SIGINT", "SIGTERM"}) do
      watchers[#watchers + 1] = core.signal(core[name], function(sig)
        sched.run_terminate_hooks()
        pcall(require("rpchost.trace").flush)
        io.stdout:flush()
        io.stderr:flush()
        os.exit(128 + sig)
      end, true) -- (a fallback: a script that watches the signal itself decides)
    end
    return watchers
  end
  -- a rank started by `rpchost run` goes when its launcher goes, even by SIGKILL
  local launcher_pid = tonumber(os.getenv("RPCHOST_LAUNCHER_PID"))
  if launcher_pid then core.die_with_parent(launcher_pid) end
  share_of_host()

  -- The script's chunk, called from a table slot rather than a named local:
  -- its frame then reads "in main chunk", as luajit's does, not "in function 'f'".
  local function run_chunk(f)
    local slot = {f}
    slot[1](unpack(arg, 1, #arg))
  end

  local function main()
    if version and not interactive then io.stdout:write(M.version_string(), "\n") end
    for _, a in ipairs(actions) do
      if a[1] == "-e" then
        local f, err = loadstring(a[2], "=(command line)")
        if not f then error(err, 0) end
        f()
      else
        _G[a[2]] = require(a[2])
      end
    end
    local run_stdin = script == "-" or (script == nil and #actions == 0 and not version
                                        and not core.isatty(0))
    if script and script ~= "-" then
      local f, err = loadfile(script)
      if not f then error(err, 0) end
      if not interactive then stop_watchers = on_stop_signals() end
      run_chunk(f)
    elseif run_stdin then
      local f, err = loadstring(io.stdin:read("*a"), "=stdin")
      if not f then error(err, 0) end
      run_chunk(f)
    end
    if interactive or (script == nil and #actions == 0 and not version and core.isatty(0)) then
      M.interactive()
    end
  end

  -- the error is reported the moment the script fails, not after the exit hooks
  -- error() with no value is how busted (and others) ask for a quiet exit 1
  local failed = false
  local ok, err = sched.run(main, script and ("script " .. script) or "main", function(e)
    failed = true
    if e ~= nil then report(e) end
  end)
  require("rpchost.trace").flush()
  if not ok then
    -- (a failure the task did not raise itself: the loop found it deadlocked)
    if not failed and err ~= nil then report(err) end
    return 1
  end
  return 0
end

-- the subcommands, each a module whose main(argv) takes the arguments after it
local SUBCOMMANDS = {run = "rpchost.tools.launcher", top = "rpchost.tools.top", repl = "rpchost.tools.repl",
                     plot = "rpchost.tools.plot"}

function M.main(argv)
  local sub = SUBCOMMANDS[argv[1]]
  if sub then
    local rest = {[0] = argv[0]}
    for j = 2, #argv do rest[#rest + 1] = argv[j] end
    return require(sub).main(rest)
  end
  return interpreter(argv)
end

return M
