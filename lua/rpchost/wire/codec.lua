-- rpchost.wire.codec: the Lua half of the value codec (the C half is l_codec.c).
--
-- C codes plain values; this module decides what everything else becomes:
--   * functions reachable from the globals or a loaded module travel by name
--     (like PyTorch pickles by qualified name) and are looked up on the callee,
--     requiring the module there if needed; so do classes (callable tables
--     reachable by name, such as nn.Linear) and names given as strings. What a
--     loaded module holds is named through the module even where a global holds
--     it too (the REPL's `tensor` is a global, a script's is a local), and a
--     global path the callee lacks is looked up among its loaded modules;
--   * other Lua functions travel by value (bytecode and upvalues), and the callee
--     accepts them only when `allow_bytecode` is set for the message's source;
--     there they see the callee's globals and the rpchost modules;
--   * objects whose metatable has a codec registered (WorkerInfo, error objects,
--     later tensors and RRefs) use it; tables whose metatable is reachable by name
--     (a class) travel as their fields plus that name; so do sized objects
--     (rpchost.sized: a userdata proxy in front of such a table), made sized again
--     on arrival;
--   * 64-bit integer cdata travel exactly.
-- Anything else (coroutines, foreign userdata) is an error naming its path.
--
-- A message's state lives in a context passed in, not in this module: an
-- encode context (encode_context: where the message goes, where its CUDA
-- tensors land, its autograd context, and the payload segments the encode
-- fills) or a decode context (decode_context: where it came from, whether it
-- may bring bytecode, its segments, and what its values left to do after).
-- The codecs registered for values (register_extension) get that context as
-- their first argument, as PyTorch's _InternalRPCPickler keeps its tensor table
-- inside serialize. What the layers above decide (which functions are
-- async_execution ones) is registered with set_hooks.
local core = require "rpchost.core"
local ffi = require "ffi"
local errors = require "rpchost.errors"
local sized = require "rpchost.sized"
-- (LuaJIT's: a table made with room for what it will hold)
local new_table = require "table.new"

local M = {}

local TAG = {INT64 = 1, UINT64 = 2, FUNC_NAME = 16, FUNC_VALUE = 17, ERROR = 18,
             WORKER_INFO = 19, OBJECT = 20, NAMED = 21, RREF = 22, TENSOR = 23, FUNC_VALUE_ASYNC = 24}

M.TAG = TAG

-- Marks that travel with a function sent by value: whether a function is an
-- async_execution one, and how to mark one that arrives (registered by the rpc
-- layer, which owns the marks: set_hooks).
local is_async = function() return false end
local mark_async = function() end
local HOOKS = {is_async = true, mark_async = true}

-- set_hooks{is_async = fn(f) -> bool, mark_async = fn(f)}: what the layers
-- above decide about values this codec carries. Only those keys.
function M.set_hooks(h)
  for k, f in pairs(h) do
    if not HOOKS[k] then error(("rpchost.wire.codec.set_hooks: no hook named '%s'"):format(tostring(k)), 2) end
    if type(f) ~= "function" then error(("rpchost.wire.codec.set_hooks: %s must be a function"):format(k), 2) end
  end
  if h.is_async then is_async = h.is_async end
  if h.mark_async then mark_async = h.mark_async end
end

-- (a decode context's allow_bytecode, set by the receiver: may by-value
-- functions be loaded? Refused when not, and outside a message)
M.bytecode_refusal = "a function sent by value (a closure) was refused: only a world whose every rank " ..
  "proved the security token (or, under Slurm, its user by MUNGE), or a loopback-only one, accepts bytecode; set " ..
  "RPCHOST_TOKEN (or security_token in the backend options) on every rank, or send a global or module function, " ..
  "which travels by name"

-- names: value <-> where it is reachable -------------------------------------
local names = setmetatable({}, {__mode = "k"})
-- functions whose name is a global's (the C codec writes and reads those
-- itself while that global is still the function: bindings/l_codec.c)
local global_names = setmetatable({}, {__mode = "k"})

-- The value a dotted name ("mod.fn", "nn.Linear", "rpchost.rref.fetch") has
-- here: a global path first, else the longest prefix that is a module (loaded,
-- or required now), then its fields.
local function resolve_dotted(name)
  local parts = {}
  for part in name:gmatch("[^.]+") do parts[#parts + 1] = part end
  local function walk(v, from)
    for i = from, #parts do
      if type(v) ~= "table" then return nil end
      v = rawget(v, parts[i])
    end
    return v
  end
  local v = walk(rawget(_G, parts[1]), 2)
  if v ~= nil then return v end
  for i = #parts, 1, -1 do
    local mod = table.concat(parts, ".", 1, i)
    local m = package.loaded[mod]
    if m == nil then
      local ok, r = pcall(require, mod)
      m = ok and r or nil
    end
    if m ~= nil then return walk(m, i + 1) end
  end
  return nil
end

-- The rpchost modules by their usual names: what a caller may hold in a global
-- (the REPL's `tensor`) where a callee's script keeps it in a local.
local MODULES = {rpc = "rpc", dist = "dist", tensor = "tensor", nn = "nn", optim = "optim",
                 dist_autograd = "dist_autograd"}

-- The module a global path's first part names here, when this worker has no
-- such global: a module loaded here under that name, or an rpchost module
-- (required now). A caller whose `tensor` is a global sends tensor.ones as
-- {"g", "tensor", "ones"}; a callee that keeps tensor in a local of its script
-- finds it through package.loaded all the same. Other names are not required
-- on a global path's behalf: a global is not a module.
local function module_for_global(name)
  local m = package.loaded[name]
  if m == nil and MODULES[name] then
    local ok, r = pcall(require, MODULES[name])
    m = ok and r or nil
  end
  return m
end

local function resolve(path)
  local v
  if path[1] == "s" then return type(path[2]) == "string" and resolve_dotted(path[2]) or nil end
  if path[1] == "g" then
    v = rawget(_G, path[2])
    if v == nil then v = module_for_global(path[2]) end
  else
    v = package.loaded[path[2]]
    if v == nil then
      local ok, m = pcall(require, path[2])
      v = ok and m or nil
    end
  end
  for i = 3, #path do
    if type(v) ~= "table" then return nil end
    v = rawget(v, path[i])
  end
  return v
end
M.resolve = resolve

-- (a module's path wins over a global one: see scan)
local function note(v, path)
  local t = type(v)
  if t ~= "function" and t ~= "table" then return end
  local had = names[v]
  if had == nil or (had[1] == "g" and path[1] == "m") then names[v] = path end
end

-- Names are found breadth first (the shortest name wins) through the globals
-- and the loaded modules, into tables of tables to this depth (a class at
-- models.resnet.Bottleneck), looking at this many entries at most.
local SCAN_DEPTH, SCAN_BUDGET = 5, 50000
M.SCAN_DEPTH = SCAN_DEPTH
-- An object: an instance of a class (its metatable indexes itself) or a value
-- with a codec of its own (an RRef, a tensor).
local by_mt_ref
local function is_object(v)
  local mt = getmetatable(v)
  return mt ~= nil and (rawget(mt, "__index") == mt or by_mt_ref[mt] ~= nil)
end

local function scan()
  local queue, head, seen, budget = {}, 1, {[_G] = true, [package] = true, [package.loaded] = true}, SCAN_BUDGET
  local queued = {} -- table -> its entry in the queue
  local function visit(t, path)
    for k, v in pairs(t) do
      budget = budget - 1
      if budget <= 0 then return end
      if type(k) == "string" then
        local tv = type(v)
        if tv == "function" or tv == "table" then
          local p = {unpack(path)}
          p[#p + 1] = k
          note(v, p)
          -- (into namespaces and classes, not into lists or objects: those hold
          -- data, and a live object the scan touched could outlive its holder)
          if tv == "table" and not seen[v] and #p < SCAN_DEPTH + 1 and rawget(v, 1) == nil and not is_object(v) then
            seen[v] = true
            local item = {v, p}
            queue[#queue + 1] = item
            queued[v] = item
          end
        end
      end
    end
  end
  visit(_G, {"g"})
  -- A loaded module is named as a module even where a global holds it too (the
  -- REPL's `tensor`, a script's global `nn`), and so is everything in
  -- it: the callee requires a module by its name, where a global of the
  -- caller's may be a local of the callee's script. (Its global path is still
  -- in the queue, not yet walked: its entry takes the module's path instead.)
  -- Shortest module name first, so that a module loaded under two names
  -- (`tensor` and `rpchost.tensor`) is always named by the same, shorter one.
  local mods = {}
  for mod, m in pairs(package.loaded) do
    if type(mod) == "string" and m ~= _G then mods[#mods + 1] = mod end
  end
  table.sort(mods, function(x, y) if #x ~= #y then return #x < #y end return x < y end)
  for _, mod in ipairs(mods) do
    local m = package.loaded[mod]
    local p = {"m", mod}
    note(m, p)
    local item = queued[m]
    if item then
      if item[2][1] == "g" then item[2] = p end
    elseif type(m) == "table" and not seen[m] then
      seen[m] = true
      item = {m, p}
      queue[#queue + 1] = item
      queued[m] = item
    end
  end
  while head <= #queue and budget > 0 do
    local item = queue[head]
    head = head + 1
    visit(item[1], item[2])
  end
end

-- The path by which `v` (a function or table) is reachable, or nil.
function M.name_of(v)
  local p = names[v]
  if p and resolve(p) == v then return p end
  names[v], global_names[v] = nil, nil
  scan()
  p = names[v]
  if p and resolve(p) == v then return p end
  return nil
end

function M.path_string(p)
  if p[1] == "s" then return tostring(p[2]) end
  if p[1] == "g" then return table.concat(p, ".", 2) end
  local s = p[2]
  if #p > 2 then s = s .. "." .. table.concat(p, ".", 3) end
  return s
end

-- codecs registered per metatable and per tag ----------------------------------
-- Each gets the message's context first: an encode context while a message is
-- encoded, a decode context while one is decoded, nil outside a message
-- (M.encode, M.decode without one).
local by_mt = {}     -- metatable -> function(ctx, v) return tag, ... end
by_mt_ref = by_mt
local by_tag = {}    -- tag -> function(ctx, ...) return value end

-- register_extension{mt = <metatable>, tag = <TAG value>, encode = fn(ctx, v) ->
-- tag, ..., decode = fn(ctx, ...) -> value}: how values of a metatable travel
-- and how a tag's values are made again (either half may be left out: a
-- metatable that must not travel raises from its encode).
function M.register_extension(x)
  local function check(f, what)
    if type(f) ~= "function" then error("rpchost.wire.codec.register_extension: " .. what .. " must be a function", 3) end
  end
  if x.mt ~= nil then
    check(x.encode, "encode")
    by_mt[x.mt] = x.encode
  end
  if x.tag ~= nil then
    check(x.decode, "decode")
    by_tag[x.tag] = x.decode
  end
end

-- Whether values of metatable mt have a wire form of their own (RRefs, tensors,
-- Futures, WorkerInfo, error objects: rpchost's runtime objects, whose fields
-- are their bookkeeping), not the fields-and-class-name of a plain object.
function M.has_extension(mt) return mt ~= nil and by_mt[mt] ~= nil end

local Named = {} -- marks a table that travels as a reference to its name
Named.__index = Named

local function encode_function(f)
  local p = M.name_of(f)
  if p then
    if p[1] == "g" and p[3] == nil and type(p[2]) == "string" then global_names[f] = p[2] end
    return TAG.FUNC_NAME, unpack(p)
  end
  local ok, code = pcall(string.dump, f)
  if not ok then
    error("a C function that is not reachable by name cannot be sent (make it a global or a module field)", 0)
  end
  local ups = {}
  local n = 0
  for i = 1, 255 do
    local name, v = debug.getupvalue(f, i)
    if name == nil then break end
    n = i
    -- Modules and globals captured by a closure refer to the callee's own copy.
    if type(v) == "table" and getmetatable(v) == nil then
      local vp = M.name_of(v)
      if vp then v = setmetatable({path = vp}, Named) end
    end
    ups[i] = v
  end
  return is_async(f) and TAG.FUNC_VALUE_ASYNC or TAG.FUNC_VALUE, code, unpack(ups, 1, n)
end

by_mt[Named] = function(_, v) return TAG.NAMED, unpack(v.path) end
Named.__tostring = function(v) return M.path_string(v.path) end

-- What a name made by by_name stands for here (any other value as it is).
function M.named_value(v)
  if getmetatable(v) ~= Named then return v end
  local x = resolve(v.path)
  if x == nil then
    error(errors.new("config", ("function or value '%s' is not defined on this worker"):format(M.path_string(v.path))), 0)
  end
  return x
end

-- A dotted name ("mod.fn") standing for what has that name on the callee: a
-- call's function given as a string (how the REPL calls what only the world
-- defines). It travels as that name and is looked up there.
function M.by_name(s)
  if type(s) ~= "string" or not s:match("^[%a_][%w_]*$") and not s:match("^[%a_][%w_]*[%w_.]*[%w_]$")
     or s:find("..", 1, true) then
    error(errors.new("config", ("'%s' is not a function name: name one as \"fn\" or \"mod.fn\" (letters, digits, " ..
      "'_', parts joined by '.')"):format(tostring(s))), 0)
  end
  return setmetatable({path = {"s", s}}, Named)
end

-- the context of the message being encoded, and of the one being decoded (nil
-- outside encode_message and decode_message): given to the value codecs
local out_ctx, in_ctx = nil, nil

local function encode_hook(v)
  local t = type(v)
  if t == "function" then return encode_function(v) end
  if t == "table" or t == "userdata" then
    local mt = getmetatable(v)
    local enc = by_mt[mt]
    if enc then return enc(out_ctx, v) end
    -- a sized object travels as the object behind it (of the same class)
    if t == "userdata" and sized.is(v) then v, t = sized.raw(v), "table" end
    -- a class (a callable table that is itself a metatable: nn.Linear, a user's
    -- Net) travels by name, like a function, so the callee uses its own class
    if t == "table" and mt ~= nil and mt.__call ~= nil and rawget(v, "__index") ~= nil then
      local p = M.name_of(v)
      if p then return TAG.NAMED, unpack(p) end
    end
    if t == "table" and mt ~= nil then
      -- an object of a class reachable by name: its fields and the class's name
      local p = M.name_of(mt)
      if p then
        local fields = {}
        for k, x in pairs(v) do fields[k] = x end
        return TAG.OBJECT, fields, unpack(p)
      end
      -- a class (nn.Linear, a user's ParameterServer: a table reachable by
      -- name that is no instance) is the callee's own, by that name; an
      -- instance of an unnamed class is refused below, never swapped for the
      -- callee's object of the same name
      if not is_object(v) then
        p = M.name_of(v)
        if p then return TAG.NAMED, unpack(p) end
      end
      error(("a table with a metatable cannot be sent: neither it nor its metatable (its class) is " ..
        "reachable by name (looked in the globals and the loaded modules, %d levels deep); make the " ..
        "class a global or a module field, or send a plain table"):format(SCAN_DEPTH), 0)
    end
    error(("a %s cannot be sent"):format(t == "userdata" and "userdata of unknown type" or t), 0)
  end
  if t == "cdata" then
    if ffi.istype("int64_t", v) then
      return TAG.INT64, ffi.string(ffi.new("int64_t[1]", v), 8)
    elseif ffi.istype("uint64_t", v) then
      return TAG.UINT64, ffi.string(ffi.new("uint64_t[1]", v), 8)
    end
    error("a cdata value other than int64_t/uint64_t cannot be sent", 0)
  end
  if t == "thread" then error("a coroutine cannot be sent", 0) end
  error(("a %s cannot be sent"):format(t), 0)
end

local function lookup_failed(p)
  error(("function or value '%s' is not defined on this worker (it travels by name: " ..
         "define it, or require its module, on every worker)"):format(M.path_string(p)), 0)
end

by_tag[TAG.FUNC_NAME] = function(_, kind, name, ...)
  -- (a global, the usual case, is one lookup: no path table per call)
  if kind == "g" and select("#", ...) == 0 and type(name) == "string" then
    local v = rawget(_G, name)
    if v == nil then v = module_for_global(name) end
    if v == nil then lookup_failed({kind, name}) end
    return v
  end
  local p = {kind, name, ...}
  -- (a name from the network: its parts must be strings, or it names nothing)
  for i = 1, #p do
    if type(p[i]) ~= "string" then
      error(("malformed message: a name's part %d is a %s, not a string"):format(i, type(p[i])), 0)
    end
  end
  local v = resolve(p)
  if v == nil then lookup_failed(p) end
  return v
end
by_tag[TAG.NAMED] = by_tag[TAG.FUNC_NAME]
-- The globals a function sent by value sees: this worker's, and the rpchost
-- modules by their usual names even where this worker's script keeps them in
-- locals (a closure typed at the REPL says `tensor.ones(2)`). Assignments go to
-- the real globals.
local remote_env = setmetatable({}, {
  __index = function(_, k)
    local v = rawget(_G, k)
    if v == nil and MODULES[k] then v = require(MODULES[k]) end
    return v
  end,
  __newindex = _G,
})
M.remote_env = remote_env

by_tag[TAG.FUNC_VALUE] = function(ctx, code, ...)
  if not (ctx and ctx.allow_bytecode) then error(M.bytecode_refusal, 0) end
  local f, err = load(code, "=remote function", "b")
  if not f then error("cannot load a function sent by value: " .. tostring(err), 0) end
  setfenv(f, remote_env)
  for i = 1, select("#", ...) do
    debug.setupvalue(f, i, (select(i, ...)))
  end
  return f
end
by_tag[TAG.FUNC_VALUE_ASYNC] = function(ctx, ...)
  local f = by_tag[TAG.FUNC_VALUE](ctx, ...)
  mark_async(f)
  return f
end
by_tag[TAG.OBJECT] = function(_, fields, ...)
  local p = {...}
  local mt = resolve(p)
  if type(mt) ~= "table" then lookup_failed(p) end
  local obj = setmetatable(fields, mt)
  if sized.is_class(mt) then return sized.new(obj) end
  return obj
end
-- a 64-bit integer is exactly 8 bytes: a shorter payload from the network would
-- make ffi.copy read past it, a longer one is not a value this codec wrote
local function int64_payload(s, what)
  if type(s) ~= "string" or #s ~= 8 then
    error(("malformed message: a %s value has %d payload bytes, not 8"):format(what,
      type(s) == "string" and #s or 0), 0)
  end
  return s
end
by_tag[TAG.INT64] = function(_, s)
  local b = ffi.new("int64_t[1]"); ffi.copy(b, int64_payload(s, "int64"), 8); return b[0]
end
by_tag[TAG.UINT64] = function(_, s)
  local b = ffi.new("uint64_t[1]"); ffi.copy(b, int64_payload(s, "uint64"), 8); return b[0]
end

-- error objects travel as their fields
M.register_extension{mt = errors.Error, tag = TAG.ERROR,
  encode = function(_, e)
    local f = {}
    for k, v in pairs(e) do
      if k ~= "local_traceback" then f[k] = v end
    end
    return TAG.ERROR, f
  end,
  decode = function(_, f) return setmetatable(f, errors.Error) end}

local function decode_hook(tag, ...)
  local dec = by_tag[tag]
  if not dec and tag == TAG.TENSOR then
    -- a tensor sent to a rank whose script never required "tensor": load the
    -- module (it registers its decoder) rather than call the message malformed
    local ok, why = pcall(require, "tensor")
    if not ok then
      error("a tensor arrived but the tensor module cannot be loaded here: " .. tostring(why), 0)
    end
    dec = by_tag[tag]
  end
  if not dec then error(("malformed message: unknown value tag %d"):format(tag), 0) end
  return dec(in_ctx, ...)
end

core.set_codec_hooks(encode_hook, decode_hook)
core.set_codec_names(global_names, _G, TAG.FUNC_NAME)

-- Messages with payload segments: bulk values (tensors) registered with
-- `segment` travel beside the encoded body instead of inside it. Most messages
-- have none: they share one read-only empty list, and a context is reused from
-- message to message by whoever sends or receives them (nothing is allocated
-- per small message).
local EMPTY = setmetatable({}, {__newindex = function()
  error("rpchost.wire.codec: the shared empty segment list is read-only", 2)
end})
M.EMPTY = EMPTY

-- An encode context: its owner sets, before each encode_message,
--   dest     the rank the message goes to (an RRef's fork is made for it);
--   devices  where CUDA tensors land (rpchost.tensor.wire reads it: {identity =
--            true} keeps them where they are; else {map =, to =, reply =});
--   ag       the distributed autograd context the message travels in, or false;
-- and the encode fills, for that message only (cleared when it returns):
--   segments the payload list (made on first use), index (value -> its segment
--            number), actions (what runs once the whole message encoded).
-- fields: a table to make the context of (its dest, devices, ag), or nil.
function M.encode_context(fields)
  local c = fields or {}
  -- (false, not nil: the keys stay in the table, which keeps its shape)
  c.segments, c.index, c.actions, c.nactions = false, false, false, 0
  if c.ag == nil then c.ag = false end
  return c
end

-- A decode context: its owner sets, before each decode_message,
--   src             the rank a call's request or reply came from, where the
--                   gradients of its tensors go back (nil for other messages);
--   allow_bytecode  whether functions sent by value may be loaded;
-- the decode sets segments and cache (segment number -> the value made of it,
-- so sharing is kept) for the message and clears them after; values that leave
-- work for after the decode note it (unconfirmed: the UserRRefs that wait for
-- their owner's confirmation, rpchost.rpc.rref), read by the owner once
-- decode_message returned and reset by the next one.
function M.decode_context(fields)
  local c = fields or {}
  c.segments, c.cache, c.unconfirmed = false, false, false
  if c.allow_bytecode == nil then c.allow_bytecode = false end
  return c
end

-- Registers v as a segment of the message ctx encodes (once per value); returns
-- its number, or nil outside a message (ctx nil: the caller then inlines).
function M.segment(ctx, v, payload)
  if not ctx then return nil end
  local segs = ctx.segments
  if not segs then
    segs = {}
    ctx.segments = segs
  end
  local index = ctx.index
  if not index then
    index = {}
    ctx.index = index
  end
  local i = index[v]
  if i then return i end
  segs[#segs + 1] = payload
  i = #segs
  index[v] = i
  return i
end

-- The segment number v already has in the message ctx encodes, or nil.
function M.segment_index(ctx, v)
  local index = ctx and ctx.index
  return index and index[v] or nil
end

-- Values whose encoding has effects (an RRef fork) register them here; they run
-- only if the whole message encodes (nothing happens outside a message).
function M.after_encode(ctx, fn)
  if not ctx then return end
  local actions = ctx.actions
  if not actions then
    actions = {}
    ctx.actions = actions
  end
  local n = ctx.nactions + 1
  ctx.nactions = n
  actions[n] = fn
end

-- encode with segments for the message ctx describes: body, {segments} (the
-- list is M.EMPTY, shared and read-only, when there are none), and the
-- segments' bytes where the codec counted them all (else nil)
function M.encode_message(ctx, root, ...)
  local prev = out_ctx
  out_ctx = ctx
  local ok, body, payload = pcall(core.encode_in, ctx, root, ...)
  out_ctx = prev
  local segs = ctx.segments or EMPTY
  -- (what this message filled goes with it: an action may itself encode a
  -- message with this same context)
  local n, todo = ctx.nactions, ctx.actions
  ctx.segments, ctx.index, ctx.actions, ctx.nactions = false, false, false, 0
  if not ok then error(body, 0) end
  for i = 1, n do todo[i]() end
  return body, segs, payload
end

-- decode with segments (a table of the frame's segments, or nil) in ctx
local function decoded_message(ctx, prev, ok, ...)
  in_ctx = prev
  ctx.segments, ctx.cache = false, false
  if not ok then error((...), 0) end
  return ...
end
function M.decode_message(ctx, body, segs)
  ctx.unconfirmed = false
  -- (the cache sized for every segment: filled one by one, an empty table grew
  -- and rehashed twice for one tensor)
  local n = segs and #segs or 0
  if n > 0 then ctx.segments, ctx.cache = segs, new_table(n, 0)
  else ctx.segments, ctx.cache = EMPTY, EMPTY end
  local prev = in_ctx
  in_ctx = ctx
  return decoded_message(ctx, prev, pcall(core.decode_in, ctx, body))
end

-- encode(names, ...) -> bytes; raises a "serialize" error object naming the path.
function M.encode(root, ...)
  local ok, s = pcall(core.encode, root, ...)
  if ok then return s end
  if errors.is(s) then error(s, 0) end
  error(errors.new("serialize", "cannot send " .. tostring(s)), 0)
end

-- decode(bytes[, ctx]) -> values; raises a "serialize" error object. With a
-- decode context, the values decode as a message's would in it (its
-- allow_bytecode, its src), with no segments.
local function decoded(prev, ok, ...)
  in_ctx = prev
  if ok then return ... end
  local e = ...
  if errors.is(e) then error(e, 0) end
  error(errors.new("serialize", tostring(e)), 0)
end
function M.decode(s, ctx)
  local prev = in_ctx
  in_ctx = ctx
  return decoded(prev, pcall(core.decode, s))
end

-- Fast paths without the pcall wrapping (caller handles errors).
M.raw_encode = core.encode
M.raw_decode = core.decode

return M
