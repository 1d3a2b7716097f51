-- spec/simhosts.lua: simulated hosts for the specs and the bench of worlds that
-- span hosts. Each host is a network namespace with its own PID, mount and UTS
-- namespaces (held by a process: `unshare` under `ip netns exec`), its own
-- hostname, /etc/hosts and private runtime directory (a tmpfs: the Unix-domain
-- sockets and world secrets of one host are not another's), on one or two
-- private networks (bridges in a namespace of their own). Nothing is shared
-- that real hosts would not share but the kernel (and so the boot id) and the
-- files the ranks run. Ranks enter a host with nsenter.
--
-- Needs root, `ip`, `unshare` and `nsenter`; available() says why not.
-- Every name carries the spec's pid: specs running side by side do not meet.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local S = require "spec.support"

local H = {}

local IP, UNSHARE, NSENTER = "/usr/sbin/ip", "/usr/bin/unshare", "/usr/bin/nsenter"

local function sh(cmd) return os.execute(cmd .. " >/dev/null 2>&1") == 0 end
H.sh = sh

-- nil when simulated hosts can be made here, else why not (one line).
function H.unavailable()
  if io.popen("id -u"):read("*l") ~= "0" then return "needs root for network, PID and mount namespaces" end
  for _, f in ipairs({IP, UNSHARE, NSENTER}) do
    if not io.open(f) then return "needs " .. f end
  end
  local probe = ("rhprobe-%d"):format(core.getpid())
  if not sh(IP .. " netns add " .. probe) then return "cannot create network namespaces here" end
  sh(IP .. " netns del " .. probe)
  if not sh(UNSHARE .. " --pid --fork --mount-proc --uts --mount true") then
    return "cannot create PID, mount and UTS namespaces here (unshare failed)"
  end
  return nil
end

-- The addresses of host i (1-based) on network A (eth0) and B (eth1).
function H.v4(i, net) return ("10.213.%d.%d"):format(net == "b" and 9 or 8, i) end
function H.v6(i, net) return ("fd77:%d::%d"):format(net == "b" and 2 or 1, i) end

local World = {}
World.__index = World

-- Makes n hosts. o: v4 (default true), v6 (default false), second (a second
-- network, eth1: default false), etc_hosts = {[i] = extra lines of host i's
-- /etc/hosts}. Returns the world, or nil and why.
function H.make(n, o)
  o = o or {}
  local tag = ("%d"):format(core.getpid() % 100000)
  local w = setmetatable({n = n, tag = tag, br = "rhbr-" .. tag, ns = {}, holders = {}, inner = {},
                          run = S.tmpdir .. "/simhosts-run", files = {}}, World)
  os.execute("mkdir -p " .. w.run)
  local ok = sh(("%s netns add %s"):format(IP, w.br))
  for _, b in ipairs(o.second and {"br0", "br1"} or {"br0"}) do
    ok = ok and sh(("%s -n %s link add %s type bridge"):format(IP, w.br, b))
      and sh(("%s -n %s link set %s up"):format(IP, w.br, b))
  end
  for i = 1, n do
    local ns = ("rhh%d-%s"):format(i, tag)
    w.ns[i] = ns
    ok = ok and sh(("%s netns add %s"):format(IP, ns)) and sh(("%s -n %s link set lo up"):format(IP, ns))
    for k, dev in ipairs(o.second and {"eth0", "eth1"} or {"eth0"}) do
      local net = k == 1 and "a" or "b"
      local peer = ("h%d%s"):format(i, net)
      ok = ok and sh(("%s -n %s link add %s type veth peer name %s netns %s"):format(IP, ns, dev, peer, w.br))
        and sh(("%s -n %s link set %s master br%d up"):format(IP, w.br, peer, k - 1))
      if o.v4 ~= false then ok = ok and sh(("%s -n %s addr add %s/24 dev %s"):format(IP, ns, H.v4(i, net), dev)) end
      if o.v6 then
        ok = ok and sh(("%s -n %s -6 addr add %s/64 dev %s nodad"):format(IP, ns, H.v6(i, net), dev))
      end
      ok = ok and sh(("%s -n %s link set %s up"):format(IP, ns, dev))
    end
    if not ok then break end
    ok = w:hold(i, o.etc_hosts and o.etc_hosts[i])
  end
  if not ok then
    w:teardown()
    return nil, "could not make the simulated hosts (ip netns, veth, bridge, unshare)"
  end
  return w
end

-- Starts the process that holds host i's PID, mount and UTS namespaces: it
-- names the host, mounts its private runtime directory and its /etc/hosts,
-- then sleeps; true once it is there.
function World:hold(i, hosts_lines)
  local setup = {("hostname h%d"):format(i), ("mount -t tmpfs -o mode=0700 tmpfs %s"):format(self.run)}
  if hosts_lines then
    local path = ("%s/hosts-h%d"):format(S.tmpdir, i)
    local f = assert(io.open(path, "w"))
    f:write("127.0.0.1 localhost\n::1 localhost\n", hosts_lines, "\n")
    f:close()
    setup[#setup + 1] = ("mount --bind %s /etc/hosts"):format(path)
  end
  setup[#setup + 1] = "exec sleep 100000"
  local h = S.start({"--pid", "--fork", "--kill-child", "--mount-proc", "--uts", "--mount", "--propagation",
                     "private", "/bin/sh", "-c", table.concat(setup, " && ")},
    {bin = UNSHARE, prefix = {IP, "netns", "exec", self.ns[i]}})
  self.holders[i] = h
  -- (the host's first process: unshare's child, pid 1 inside, sleeping once set up)
  local ok = pcall(S.wait_until, function()
    if h.done then error("the holder of host " .. i .. " exited: " .. table.concat(h.err), 0) end
    local f = io.open(("/proc/%d/task/%d/children"):format(h.pid, h.pid))
    local kid = f and tonumber((f:read("*a") or ""):match("%d+"))
    if f then f:close() end
    if not kid then return false end
    local c = io.open(("/proc/%d/comm"):format(kid))
    local comm = c and c:read("*l")
    if c then c:close() end
    if comm == "sleep" then self.inner[i] = kid; return true end
  end, 10, "host " .. i .. "'s namespaces", 0.02)
  return ok
end

-- The environment every rank of these hosts gets: its private runtime directory.
function World:env(extra)
  local e = {XDG_RUNTIME_DIR = self.run}
  for k, v in pairs(extra or {}) do e[k] = v end
  return e
end

-- Starts rpchost with args on host i (S.start's handle). opts: env (extra
-- variables; false unsets one), bin.
function World:start(i, args, opts)
  opts = opts or {}
  local env, unset = {XDG_RUNTIME_DIR = self.run}, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "RPCHOST_STORE_HOSTED", "RPCHOST_ERROR_FILE", "RPCHOST_TOKEN",
    "RPCHOST_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "SLURM_NNODES", "GROUP_WORLD_SIZE"}
  for k, v in pairs(opts.env or {}) do
    if v == false then unset[#unset + 1] = k else env[k] = v end
  end
  return S.start(args, {env = env, unset = unset, bin = opts.bin,
    prefix = {NSENTER, "-t", tostring(self.inner[i]), "-n", "-m", "-u", "-p", "--"}})
end

-- A link of host i (eth0 by default) down or up, from outside.
function World:link(i, state, dev)
  return sh(("%s -n %s link set %s %s"):format(IP, self.ns[i], dev or "eth0", state))
end

-- Runs a shell command inside host i's network namespace (tc, ip).
function World:exec(i, cmd)
  return sh(("%s netns exec %s %s"):format(IP, self.ns[i], cmd))
end

function World:teardown()
  for i, h in pairs(self.holders) do
    if not h.done then core.kill(h.pid, core.SIGKILL) end
    pcall(S.wait_until, function() return h.done end, 5, "host " .. i .. "'s holder to end")
  end
  for _, ns in pairs(self.ns) do sh(IP .. " netns del " .. ns) end
  sh(IP .. " netns del " .. self.br)
end

-- Waits (bounded) for every handle in hs (a list) and returns their results.
function H.wait_all(hs, timeout)
  local out, deadline = {}, sched.now() + (timeout or 60)
  for i, h in ipairs(hs) do out[i] = h:wait(math.max(deadline - sched.now(), 1)) end
  return out
end

return H
