-- Docs that cannot rot (docs/README.md, "How these pages are checked"):
--  * every Lua block of README.md and docs/*.md fenced as ```lua run (one
--    process) or ```lua world=N (N ranks under `rpchost run`) runs, exits 0,
--    and prints every `--> text` its comments promise;
--  * each reference page declares the tables it documents with
--    <!-- doc-check: EXPR as PREFIX [PREFIX...] -->; every name written PREFIXname
--    in an inline code span of that page exists in the table (read at test time,
--    so new functions are seen), and every public key of the table (a string key
--    not starting with "_") is written so at least once on that page;
--  * every environment variable the code reads (an "RPCHOST_..." string literal
--    in lua/, host/, bindings/, kernels/) is named in docs/environment.md;
--  * README.md and docs/ link only to files that exist in the repository;
--  * every command-line flag the pages give (README.md's "Command line",
--    docs/cli.md, the man page) is one `rpchost --help` shows, and every flag
--    `rpchost --help` shows is on a page;
--  * every variable docs/environment.md names is mapped (EFFECTS) to the spec
--    that shows what it does, and that spec uses it;
--  * every option an options table takes is written `name =` on its page.
-- (The docs tier: spec/troubleshooting_spec.lua, in the same tier, makes
-- every mistake docs/troubleshooting.md lists. scripts/test.sh runs the tier.)
local S = require "spec.support"

local function read(path)
  local f = assert(io.open(path))
  local s = f:read("*a")
  f:close()
  return s
end

local function ls(pattern)
  local out = {}
  local p = io.popen("ls " .. pattern .. " 2>/dev/null")
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  return out
end

local pages = ls(S.root .. "/docs/*.md")
local all_docs = {S.root .. "/README.md"}
for _, p in ipairs(pages) do all_docs[#all_docs + 1] = p end

-- the text outside fenced blocks and inline code spans (where links are)
local function prose(path)
  local out, fenced = {}, false
  for line in (read(path) .. "\n"):gmatch("([^\n]*)\n") do
    if line:match("^%s*```") then fenced = not fenced
    elseif not fenced then out[#out + 1] = (line:gsub("`[^`]*`", "")) end
  end
  return table.concat(out, "\n")
end

-- fenced blocks: {file, line, info, text}
local function blocks(path)
  local out, cur = {}, nil
  local n = 0
  for line in (read(path) .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    if cur then
      if line:match("^%s*```%s*$") then out[#out + 1] = cur; cur = nil
      else cur.text[#cur.text + 1] = line end
    else
      local info = line:match("^%s*```(.*)$")
      if info then cur = {file = path, line = n, info = info, text = {}} end
    end
  end
  return out
end

-- inline code spans outside fenced blocks
local function spans(path)
  local out, fenced = {}, false
  for line in (read(path) .. "\n"):gmatch("([^\n]*)\n") do
    if line:match("^%s*```") then fenced = not fenced
    elseif not fenced then
      for s in line:gmatch("`([^`]+)`") do out[#out + 1] = s end
    end
  end
  return out
end

-- names written PREFIXident in the spans, the prefix not preceded by a name character
local function names_after(prefix, list)
  local found = {}
  local pat = "()" .. prefix:gsub("%p", "%%%0") .. "([%a_][%w_]*)"
  for _, s in ipairs(list) do
    for at, name in s:gmatch(pat) do
      local before = at > 1 and s:sub(at - 1, at - 1) or ""
      if not before:match("[%w_%.:/]") then found[#found + 1] = name end
    end
  end
  return found
end

describe("the documentation #docs", function()
  it("runs every block marked runnable and prints what its comments promise", function()
    local ran = 0
    for _, path in ipairs(all_docs) do
      for _, b in ipairs(blocks(path)) do
        local n = b.info:match("^lua%s+world=(%d+)%s*$")
        local single = b.info:match("^lua%s+run%s*$")
        if n or single then
          local text = table.concat(b.text, "\n") .. "\n"
          local script = S.write(text)
          local r
          if n then r = S.run({"run", "--nproc-per-node", n, script}, {timeout = 90, cwd = S.root})
          else r = S.run({script}, {timeout = 90, cwd = S.root}) end
          local where = ("%s:%d"):format(path, b.line)
          assert.are.equal(0, r.status, where .. " failed:\n" .. r.out .. r.err)
          for want in text:gmatch("%-%->%s*([^\n]-)%s*\n") do
            assert.truthy(r.out:find(want, 1, true), ("%s: expected %q in its output:\n%s%s"):format(
              where, want, r.out, r.err))
          end
          ran = ran + 1
        end
      end
    end
    assert.is_true(ran >= 10, "only " .. ran .. " runnable blocks found")
  end)
end)

describe("the documentation, read #docs", function()
  it("names only what exists, and names every public function of each documented table", function()
    local checked, problems = 0, {}
    for _, path in ipairs(pages) do
      local text = read(path)
      local list = spans(path)
      for expr, prefixes in ("\n" .. text):gmatch("\n<!%-%-%s*doc%-check:%s*([^\n]-)%s+as%s+([^\n]-)%s*%-%->") do
        local f = assert(loadstring("return " .. expr))
        local ok, t = pcall(f)
        if not (ok and type(t) == "table") then
          problems[#problems + 1] = ("%s: doc-check %s does not give a table: %s"):format(path, expr, tostring(t))
        else
          local covered = {}
          for prefix in prefixes:gmatch("%S+") do
            for _, name in ipairs(names_after(prefix, list)) do
              covered[name] = true
              local has, v = pcall(function() return t[name] end)
              if not (has and v ~= nil) then
                problems[#problems + 1] = ("%s names `%s%s`, but %s has no field %s"):format(
                  path, prefix, name, expr, name)
              end
            end
          end
          local missing = {}
          for k in pairs(t) do
            if type(k) == "string" and k:sub(1, 1) ~= "_" and not covered[k] then missing[#missing + 1] = k end
          end
          table.sort(missing)
          if #missing > 0 then
            problems[#problems + 1] = ("%s does not document %s of %s (write each as `%sname` on that page)")
              :format(path, table.concat(missing, ", "), expr, prefixes:match("%S+"))
          end
          checked = checked + 1
        end
      end
    end
    assert.are.equal("", table.concat(problems, "\n"))
    assert.is_true(checked >= 10, "only " .. checked .. " doc-check tables found")
  end)

  it("names every environment variable the code reads", function()
    local env = read(S.root .. "/docs/environment.md")
    local p = io.popen("cd " .. S.root .. " && grep -rhoE '\"RPCHOST_[A-Z0-9_]+\"' lua host bindings kernels | sort -u")
    local missing, n = {}, 0
    for l in p:lines() do
      local name = l:gsub('"', "")
      n = n + 1
      if not env:find("`" .. name .. "`", 1, true) and not env:find("`" .. name .. "=", 1, true) then
        missing[#missing + 1] = name
      end
    end
    p:close()
    assert.is_true(n > 20, "found only " .. n .. " variables")
    assert.are.equal("", table.concat(missing, " "), "docs/environment.md lacks these variables")
  end)

  it("links only to files in the repository", function()
    local bad = {}
    for _, path in ipairs(all_docs) do
      local dir = path:match("^(.*)/[^/]+$")
      for target in prose(path):gmatch("%]%(([^)#%s]+)[^)]*%)") do
        if not target:match("^%a+://") and not target:match("^mailto:") then
          local f = io.open(dir .. "/" .. target)
          if f then f:close() else bad[#bad + 1] = path .. " -> " .. target end
        end
      end
      assert.is_nil(read(path):find("../shared/", 1, true), path .. " points outside the repository (../shared)")
    end
    assert.are.equal("", table.concat(bad, "\n"))
  end)
end)

-- Command-line flags (--long-name, -x) in a text: a flag follows the start of a
-- line, a space, or one of [ ( | ` and starts with a letter.
local function flags_in(text, into, where)
  for f in ("\n" .. text):gmatch("[%s%[%(|`](%-%-?%a[%w%-]*)") do
    f = f:gsub("%-+$", "")
    into[f] = into[f] or where
  end
  return into
end

-- The flags the pages give for rpchost: README.md's "Command line" block;
-- docs/cli.md's first block, its option tables and its spans that start with
-- a flag or "rpchost "; the man page, all of it.
local function documented_flags()
  local out = {}
  local readme = read(S.root .. "/README.md")
  local block = readme:match("\n## Command line\n+```\n(.-)\n```")
  assert(block, "README.md has no block under \"## Command line\"")
  flags_in(block, out, "README.md")
  local cli = S.root .. "/docs/cli.md"
  local first = read(cli):match("```\n(.-)\n```")
  flags_in(first or "", out, "docs/cli.md")
  for line in read(cli):gmatch("[^\n]+") do
    local cell = line:match("^| `(%-[^|]*)|")
    if cell then flags_in(cell, out, "docs/cli.md") end
  end
  for _, sp in ipairs(spans(cli)) do
    if sp:match("^%-") or sp:match("^rpchost ") then flags_in(sp, out, "docs/cli.md") end
  end
  for line in read(S.root .. "/docs/rpchost.1"):gmatch("[^\n]+") do
    if not line:match('^%.\\"') then flags_in((line:gsub("\\%-", "-")), out, "docs/rpchost.1") end
  end
  return out
end

describe("the command line's flags #docs", function()
  it("are the same in rpchost --help and on the pages", function()
    local r = S.run({"--help"}, {timeout = 20})
    assert.are.equal(0, r.status, r.err)
    local help = flags_in(r.out, {}, "--help")
    local pages = documented_flags()
    local problems = {}
    for f, where in pairs(pages) do
      if not help[f] then problems[#problems + 1] = ("%s gives %s, which rpchost --help does not"):format(where, f) end
    end
    for f in pairs(help) do
      if not pages[f] then problems[#problems + 1] = ("rpchost --help shows %s, which no page gives"):format(f) end
    end
    table.sort(problems)
    assert.are.equal("", table.concat(problems, "\n"))
    assert.truthy(help["--once"] and help["--nproc-per-node"] and help["-e"], r.out)
  end)
end)

-- Each variable of docs/environment.md and the spec that shows what it does:
-- {file, what it shows}; the file must use the variable by name, except where
-- `at_default` says the spec shows the effect of its default (a test of that
-- name must then be in the file). Names the page writes that are not
-- variables rpchost reads are in NOT_READ, with what they are.
local EFFECTS = {
  RANK = {"spec/launcher_spec.lua", "each rank gets its RANK"},
  WORLD_SIZE = {"spec/launcher_spec.lua", "each rank gets its WORLD_SIZE"},
  LOCAL_RANK = {"spec/launcher_spec.lua", "each rank gets its LOCAL_RANK"},
  LOCAL_WORLD_SIZE = {"spec/launcher_spec.lua", "a host's ranks share its cores by it"},
  MASTER_ADDR = {"spec/launcher_spec.lua", "ranks meet at the store it names"},
  MASTER_PORT = {"spec/launcher_spec.lua", "ranks meet at the store it names"},
  GROUP_RANK = {"spec/environment_spec.lua", "the node's index, over a launcher's"},
  OMPI_COMM_WORLD_RANK = {"spec/environment_spec.lua", "the rank under Open MPI"},
  OMPI_COMM_WORLD_SIZE = {"spec/environment_spec.lua", "the world's size under Open MPI"},
  OMPI_COMM_WORLD_LOCAL_RANK = {"spec/environment_spec.lua", "the local rank under Open MPI"},
  OMPI_COMM_WORLD_LOCAL_SIZE = {"spec/environment_spec.lua", "the ranks of the node under Open MPI"},
  OMPI_COMM_WORLD_NODE_RANK = {"spec/environment_spec.lua", "the node's index under Open MPI"},
  SLURM_JOB_ID = {"spec/environment_spec.lua", "a Slurm step: its job"},
  SLURM_STEP_ID = {"spec/environment_spec.lua", "a Slurm step: the step"},
  SLURM_PROCID = {"spec/environment_spec.lua", "the rank in a Slurm step"},
  SLURM_STEP_NUM_TASKS = {"spec/environment_spec.lua", "the world's size in a Slurm step"},
  SLURM_NTASKS = {"spec/environment_spec.lua", "the world's size, without the step's count"},
  SLURM_LOCALID = {"spec/environment_spec.lua", "the local rank in a Slurm step"},
  SLURM_NODEID = {"spec/environment_spec.lua", "the node's index in a Slurm step"},
  SLURM_STEP_TASKS_PER_NODE = {"spec/environment_spec.lua", "the ranks of the node in a Slurm step"},
  SLURM_JOBID = {"spec/slurm_env_spec.lua", "Slurm's older name of the job"},
  SLURM_STEPID = {"spec/slurm_env_spec.lua", "Slurm's older name of the step"},
  SLURM_NNODES = {"spec/slurm_env_spec.lua", "the nodes of the allocation"},
  SLURM_NODELIST = {"spec/slurm_env_spec.lua", "the hosts of the allocation"},
  SLURM_STEP_NODELIST = {"spec/slurm_env_spec.lua", "the step's hosts: the store's"},
  SLURM_STEP_NUM_NODES = {"spec/slurm_env_spec.lua", "the step's nodes"},
  SLURM_CPUS_PER_TASK = {"spec/slurm_env_spec.lua", "the cores a rank may use"},
  PMIX_RANK = {"spec/environment_spec.lua", "the rank under PMIx"},
  PMI_RANK = {"spec/environment_spec.lua", "the rank under PMI"},
  PMI_SIZE = {"spec/environment_spec.lua", "the world's size under PMI"},
  MPI_LOCALRANKID = {"spec/environment_spec.lua", "the local rank under PMI"},
  MPI_LOCALNRANKS = {"spec/environment_spec.lua", "the ranks of the node under PMI"},
  PMI_FD = {"spec/slurm_env_spec.lua", "a PMI launcher's descriptor"},
  RPCHOST_WORLD_ID = {"spec/slurm_env_spec.lua", "the world's identity at the store"},
  RPCHOST_MUNGE = {"spec/slurm_spec.lua", "MUNGE's world secret, or none"},
  RPCHOST_MUNGE_SOCKET = {"spec/slurm_spec.lua", "munged's socket"},
  RPCHOST_SOAK_MINUTES = {"spec/soak_spec.lua", "the soak's length"},
  RPCHOST_SOAK_ONLY = {"spec/soak_spec.lua", "the soak's workloads"},
  RPCHOST_LAUNCHER_PID = {"spec/launcher_spec.lua", "a rank exits when its launcher does",
    at_default = "takes its ranks with it when it is killed with SIGKILL"},
  RPCHOST_ERROR_FILE = {"spec/interpreter_spec.lua", "the launcher points at a rank's error, not repeating it"},
  RPCHOST_STORE_HOSTED = {"spec/environment_spec.lua", "no rank hosts the store the launcher hosts"},
  RPCHOST_HEARTBEAT = {"spec/multihost_spec.lua", "a silent host's peers are unreachable within it"},
  RPCHOST_SOCKET_IFNAME = {"spec/multihost_spec.lua", "the interfaces ranks listen on and advertise"},
  GLOO_SOCKET_IFNAME = {"spec/multihost_spec.lua", "the same, by gloo's name"},
  TP_SOCKET_IFNAME = {"spec/hosts_spec.lua", "the same, by TensorPipe's name"},
  RPCHOST_RESTART_COUNT = {"spec/restart_spec.lua", "which life a restarted rank is in"},
  RPCHOST_RANK_NICE = {"spec/big_world_spec.lua", "ranks take back the launcher's first niceness",
    at_default = "runs at a raised priority where it may, and its ranks at the one it had"},
  RPCHOST_TOKEN = {"spec/security_attack_spec.lua", "connections prove the token"},
  RPCHOST_INIT_TIMEOUT = {"spec/init_errors_spec.lua", "how long a world has to form"},
  RPCHOST_REPL_WATCH = {"spec/repl_spec.lua", "the REPL notices that its world stopped",
    at_default = "is told when the world stops, hides its own frames, completes objects, tensors and RRefs"},
  RPCHOST_PROGRESS_INTERVAL = {"spec/waits_spec.lua", "how often a long wait says what for"},
  RPCHOST_LOG = {"spec/bytecode_spec.lua", "debug shows rpchost's own frames"},
  RPCHOST_TRACE = {"spec/tracing_spec.lua", "a trace file of calls"},
  RPCHOST_HANDSHAKE_TIMEOUT = {"spec/security_attack_spec.lua", "unproven connections closed by the deadline"},
  RPCHOST_STORE_HANDSHAKE_TIMEOUT = {"spec/store_host_spec.lua", "the store closes a silent connection"},
  RPCHOST_TMPDIR = {"spec/security_resources_spec.lua", "where /tmp/rpchost-<uid> is looked for"},
  RPCHOST_MAX_UNPROVEN = {"spec/security_resources_spec.lua", "the cap on unproven connections"},
  RPCHOST_STORE_LINGER = {"spec/faults_spec.lua", "the store's host waits for its clients"},
  RPCHOST_STORE_NICE = {"spec/big_world_spec.lua", "the launcher's raised priority"},
  RPCHOST_MAX_QUEUED = {"spec/backpressure_spec.lua", "the bound on queued requests"},
  RPCHOST_MAX_FRAME = {"spec/large_frames_spec.lua", "the largest message"},
  RPCHOST_EARLY_MAX = {"spec/security_handshake_spec.lua", "frames held before a world is ready"},
  RPCHOST_PROBE_TIMEOUT = {"spec/environment_spec.lua", "how long a silent predecessor may take"},
  RPCHOST_MAX_DEPTH = {"spec/environment_spec.lua", "the nesting limit"},
  RPCHOST_SPIN_YIELD = {"spec/shm_ring_spec.lua", "giving the core away while polling"},
  RPCHOST_SPIN_US = {"spec/rpc_spec.lua", "the polling window"},
  RPCHOST_WAKE_AHEAD = {"spec/rpc_spec.lua", "waking ahead of regular answers"},
  RPCHOST_NUM_THREADS = {"spec/launcher_spec.lua", "the tensor thread pool's size"},
  RPCHOST_LUA_DIR = {"spec/bytecode_spec.lua", "another Lua library"},
  RPCHOST_BYTECODE = {"spec/bytecode_spec.lua", "parsing the library's source"},
  RPCHOST_CUDA_LIB = {"spec/cuda_spec.lua", "another CUDA kernels library"},
  RPCHOST_MPI_LIB = {"spec/mpi_spec.lua", "the MPI library loaded"},
  RPCHOST_MALLOC_TUNE = {"spec/environment_spec.lua", "glibc's malloc defaults"},
  RPCHOST_MEMCPY_TUNE = {"spec/environment_spec.lua", "glibc's copies on CPUs where they are slow"},
  GLIBC_TUNABLES = {"spec/environment_spec.lua", "glibc's tunables, which RPCHOST_MEMCPY_TUNE extends"},
  RPCHOST_UNIX = {"spec/local_sockets_spec.lua", "TCP between ranks of one host"},
  RPCHOST_SHM = {"spec/large_frames_spec.lua", "no shared-memory payloads"},
  RPCHOST_SHM_RING = {"spec/shm_ring_spec.lua", "small frames through the socket"},
  RPCHOST_RING_STREAM = {"spec/environment_spec.lua", "the tensors that stream through a ring"},
  RPCHOST_SHM_MIN = {"spec/environment_spec.lua", "the smallest shared-memory payload"},
  RPCHOST_SHM_ADOPT_MIN = {"spec/environment_spec.lua", "payloads that stay in shared memory"},
  RPCHOST_SHM_POOL = {"spec/tensor_rpc_spec.lua", "the cap on a peer's segments"},
  RPCHOST_CMA = {"spec/c10d_spec.lua", "no cross-memory reads"},
  RPCHOST_CMA_WRITE = {"spec/collectives_spec.lua", "read-only cross-memory all_reduce"},
  RPCHOST_RING_BYTES = {"spec/collectives_spec.lua", "where the ring all_reduce starts"},
  RPCHOST_TREE_RANKS = {"spec/big_world_spec.lua", "where the binomial tree starts"},
  RPCHOST_DIRECT_BYTES = {"spec/collectives_spec.lua", "where direct reads start"},
  RPCHOST_SHM_COLL = {"spec/shm_coll_spec.lua", "no collective arena, for the whole group"},
  RPCHOST_SHM_COLL_SPIN_US = {"spec/shm_coll_spec.lua", "an arena wait polls briefly, then sleeps",
    at_default = "serves RPCs while a rank waits in a barrier, sleeping without burning its core"},
  RPCHOST_PROTOCOL_VERSION = {"spec/init_errors_spec.lua", "the version check between ranks"},
  RPCHOST_BIN = {"spec/support.lua", "the rpchost the specs start"},
  RPCHOST_SPEC_HUGE = {"spec/large_frames_spec.lua", "the 4 GiB round trip runs"},
  RPCHOST_DIGITS = {"spec/examples_spec.lua", "another digits.csv.gz"},
  QUIET = {"spec/examples_spec.lua", "the examples print their summary only"},
  HOME = {"spec/repl_spec.lua", "the REPL's history file"},
  XDG_RUNTIME_DIR = {"spec/security_resources_spec.lua", "the private directory's first place"},
  TMPDIR = {"spec/launcher_spec.lua", "where a node puts the script it was sent"},
  USER = {"spec/security_attack_spec.lua", "the user a refusal names",
    at_default = "cannot run code in a world without a token by skipping or faking the same-user proof"},
  LOGNAME = {"spec/security_attack_spec.lua", "the user a refusal names, without USER",
    at_default = "cannot run code in a world without a token by skipping or faking the same-user proof"},
}
local NOT_READ = {
  TORCHELASTIC_RESTART_COUNT = "torchrun's name for RPCHOST_RESTART_COUNT",
  CAP_SYS_NICE = "a capability", RLIMIT_NICE = "a resource limit",
}

describe("docs/environment.md's variables #docs", function()
  it("each has a spec that shows its effect", function()
    local page = S.root .. "/docs/environment.md"
    local names = {}
    for _, sp in ipairs(spans(page)) do
      local v = sp:match("^%$?([A-Z][A-Z0-9_]+)$") or sp:match("^([A-Z][A-Z0-9_]+)=")
      if v and v:find("_", 1, true) or v == "RANK" or v == "HOME" or v == "USER" or v == "QUIET" or v == "TMPDIR" or
         v == "LOGNAME" then
        names[v] = true
      end
    end
    local problems, n = {}, 0
    for v in pairs(names) do
      n = n + 1
      local e = EFFECTS[v]
      if NOT_READ[v] then
        local p = io.popen("cd " .. S.root .. " && grep -rlF '\"" .. v .. "\"' lua host bindings | head -1")
        local used = p:read("*l")
        p:close()
        if used then problems[#problems + 1] = ("%s is listed as not read (%s), but %s reads it"):format(v, NOT_READ[v], used) end
      elseif not e then
        problems[#problems + 1] = ("docs/environment.md names %s, and no spec is mapped to it (spec/docs_spec.lua, EFFECTS)")
          :format(v)
      else
        local f = io.open(S.root .. "/" .. e[1])
        local text = f and f:read("*a") or ""
        if f then f:close() end
        if not f then problems[#problems + 1] = ("%s: %s does not exist"):format(v, e[1])
        elseif e.at_default then
          if not text:find(e.at_default, 1, true) then
            problems[#problems + 1] = ("%s: %s has no test \"%s\""):format(v, e[1], e.at_default)
          end
        elseif not text:find(v, 1, true) then
          problems[#problems + 1] = ("%s: %s never uses it"):format(v, e[1])
        end
      end
    end
    for v in pairs(EFFECTS) do
      if not names[v] then problems[#problems + 1] = ("EFFECTS maps %s, which docs/environment.md does not name"):format(v) end
    end
    table.sort(problems)
    assert.are.equal("", table.concat(problems, "\n"))
    assert.is_true(n > 50, "found only " .. n .. " variables")
  end)
end)

-- Options tables and the page that documents each: every option the table
-- takes (as its unknown-key error lists them) is written `name =` there.
local OPTIONS = {
  {"docs/rpc.md", "rpc.init_rpc", function() require("rpc").init_rpc("w", {no_such_option = 1}) end},
  {"docs/rpc.md", "rpc.TensorPipeRpcBackendOptions",
   function() require("rpc").TensorPipeRpcBackendOptions{no_such_option = 1} end},
  {"docs/rpc.md", "rpc.ProcessGroupRpcBackendOptions",
   function() require("rpc").ProcessGroupRpcBackendOptions{no_such_option = 1} end},
  {"docs/dist.md", "dist.init_process_group", function() require("dist").init_process_group{no_such_option = 1} end},
}

describe("options tables #docs", function()
  it("document every option they take, on the row of their call", function()
    local problems = {}
    for _, o in ipairs(OPTIONS) do
      local page, call, make = o[1], o[2], o[3]
      local ok, e = pcall(make)
      local list = not ok and tostring(type(e) == "table" and e.message or e):match("%(options: ([^)]*)%)")
      if not list then problems[#problems + 1] = ("%s did not list its options: %s"):format(call, tostring(e))
      else
        -- the row of the page that documents the call
        local row
        for line in read(S.root .. "/" .. page):gmatch("[^\n]+") do
          if line:find("| `" .. call, 1, true) == 1 then row = line break end
        end
        if not row then problems[#problems + 1] = ("%s has no row for %s"):format(page, call)
        else
          for name in list:gmatch("[%w_]+") do
            if not (row:find(name .. " =", 1, true) or row:find(name .. "=", 1, true)) then
              problems[#problems + 1] = ("%s's row of %s does not give its option %s (as `%s =`)"):format(page, call,
                name, name)
            end
          end
        end
      end
    end
    assert.are.equal("", table.concat(problems, "\n"))
  end)
end)
