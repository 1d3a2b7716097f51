-- rpchost.repl: `rpchost repl`. Without a world address it starts a one-rank local
-- world (so rpc calls to oneself work) and opens the interactive prompt.
-- Joining a running world needs dynamic membership, which is not built yet:
-- asking for it is refused with a clear message instead of a hang.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local cli = require "rpchost.cli"

local M = {}

function M.main(argv)
  local o = {name = "repl"}
  local i = 1
  while argv[i] do
    local a = argv[i]
    if a == "--master-addr" then o.addr = argv[i + 1]; i = i + 2
    elseif a == "--master-port" then o.port = argv[i + 1]; i = i + 2
    elseif a == "--name" then o.name = argv[i + 1]; i = i + 2
    elseif a == "-h" or a == "--help" then
      io.stdout:write("usage: rpchost repl [--name NAME]\n")
      return 0
    else
      io.stderr:write("rpchost repl: unknown option ", a, "\n")
      return 2
    end
  end
  if o.addr or o.port then
    io.stderr:write("rpchost repl: joining a running world (--master-addr/--master-port) needs " ..
      "dynamic membership, which this build does not have yet; start the REPL without them " ..
      "for a local one-rank world, or use `rpchost -i script.lua` as a rank of the world\n")
    return 2
  end
  local ok, err = sched.run(function()
    local rpc = require "rpc"
    local port = core.listen("127.0.0.1", 0, {accept = function(c) c:close() end})
    local p = port:port()
    port:close()
    rpc.init_rpc(o.name, {rank = 0, world_size = 1, rpc_backend_options =
      rpc.TensorPipeRpcBackendOptions{init_method = ("tcp://127.0.0.1:%d"):format(p)}})
    _G.rpc = rpc
    cli.interactive()
    rpc.shutdown()
  end, "repl")
  if not ok then
    io.stderr:write("rpchost repl: ", cli.format_error(err), "\n")
    return 1
  end
  return 0
end

return M
