-- rpchost.tensor.pickle: the restricted pickle codec inside PyTorch's .pt files
-- (data.pkl), for state_dicts and the nested containers optimizers keep.
--
-- Reading follows PyTorch's own weights_only unpickler (torch 1.13's
-- torch/_weights_only_unpickler.py): nothing named in the bytes is ever looked up
-- or called. A GLOBAL may name only what a state_dict needs (collections.
-- OrderedDict, torch._utils._rebuild_tensor_v2 / _rebuild_tensor /
-- _rebuild_parameter, torch.nn.parameter.Parameter and the torch.*Storage
-- classes), each of which maps to a fixed Lua constructor here; REDUCE and NEWOBJ
-- run only those; BUILD only sets an OrderedDict's attributes (PyTorch's
-- `_metadata`, dropped); APPEND(S) only extends lists, SET-ITEM(S) only fills
-- dicts; a persistent id is only ('storage', class, key, location, numel). Every
-- other opcode (INST, OBJ, EXT, the text opcodes of protocols 0 and 1, POP, DUP,
-- ...) and every other global is refused with an error naming it, before
-- anything is built from it. Protocol 2 is what torch.save writes; the opcodes
-- protocols 3-5 add for the same things (FRAME, MEMOIZE, SHORT_BINUNICODE,
-- STACK_GLOBAL, bytes, sets) are read too.
--
-- Python values become Lua values: None -> nil (a dict entry whose value is None
-- is absent; a list keeps a hole), bool -> boolean, int -> number (int64 cdata past
-- 2^53), float -> number, str and bytes -> string, list and tuple -> a 1-based
-- array, dict and OrderedDict -> a table with the same keys (ints stay ints, so an
-- optimizer's state keeps PyTorch's parameter numbers), marked as a dict in
-- rpchost.mapping with its key order recorded, set -> a table of element -> true,
-- a tensor -> whatever ctx.tensor makes of it (rpchost.tensor.pt_format reads its
-- storage).
--
-- Writing (dumps) is the same subset the other way, protocol 2 as torch.save
-- writes it, so torch.load(path, weights_only=True) reads it: a table whose keys
-- are 1..n is a list unless rpchost.mapping marks it a dict; an OrderedDict where
-- it is marked so or its key order is recorded (a module's state_dict()); numbers
-- that are whole (below 2^53) are ints, others floats.
local ffi = require "ffi"
local bit = require "bit"
local mapping = require "rpchost.mapping"

local M = {}

local NAMES = {
  [0x28] = "MARK", [0x2e] = "STOP", [0x30] = "POP", [0x31] = "POP_MARK", [0x32] = "DUP", [0x46] = "FLOAT",
  [0x49] = "INT", [0x4a] = "BININT", [0x4b] = "BININT1", [0x4c] = "LONG", [0x4d] = "BININT2", [0x4e] = "NONE",
  [0x50] = "PERSID", [0x51] = "BINPERSID", [0x52] = "REDUCE", [0x53] = "STRING", [0x54] = "BINSTRING",
  [0x55] = "SHORT_BINSTRING", [0x56] = "UNICODE", [0x58] = "BINUNICODE", [0x61] = "APPEND", [0x62] = "BUILD",
  [0x63] = "GLOBAL", [0x64] = "DICT", [0x7d] = "EMPTY_DICT", [0x65] = "APPENDS", [0x67] = "GET", [0x68] = "BINGET",
  [0x69] = "INST", [0x6a] = "LONG_BINGET", [0x6c] = "LIST", [0x5d] = "EMPTY_LIST", [0x6f] = "OBJ", [0x70] = "PUT",
  [0x71] = "BINPUT", [0x72] = "LONG_BINPUT", [0x73] = "SETITEM", [0x74] = "TUPLE", [0x29] = "EMPTY_TUPLE",
  [0x75] = "SETITEMS", [0x47] = "BINFLOAT", [0x80] = "PROTO", [0x81] = "NEWOBJ", [0x82] = "EXT1", [0x83] = "EXT2",
  [0x84] = "EXT4", [0x85] = "TUPLE1", [0x86] = "TUPLE2", [0x87] = "TUPLE3", [0x88] = "NEWTRUE", [0x89] = "NEWFALSE",
  [0x8a] = "LONG1", [0x8b] = "LONG4", [0x42] = "BINBYTES", [0x43] = "SHORT_BINBYTES", [0x8c] = "SHORT_BINUNICODE",
  [0x8d] = "BINUNICODE8", [0x8e] = "BINBYTES8", [0x8f] = "EMPTY_SET", [0x90] = "ADDITEMS", [0x91] = "FROZENSET",
  [0x92] = "NEWOBJ_EX", [0x93] = "STACK_GLOBAL", [0x94] = "MEMOIZE", [0x95] = "FRAME", [0x96] = "BYTEARRAY8",
  [0x97] = "NEXT_BUFFER", [0x98] = "READONLY_BUFFER",
}

local function opname(op)
  local ch = (op >= 32 and op < 127) and ("'%s'"):format(string.char(op)) or ("0x%02x"):format(op)
  return NAMES[op] and (NAMES[op] .. " (" .. ch .. ")") or ("unknown opcode " .. ch)
end

-- The storage classes a persistent id may name: the rpchost dtype id of each
-- (nil for a dtype rpchost lacks) and PyTorch's name for the dtype. Any other
-- torch.<X>Storage is read as a dtype rpchost lacks, so the error can name it
-- and the key it belongs to.
local STORAGE_DTYPES = {
  FloatStorage = {0, "float32"}, DoubleStorage = {1, "float64"}, IntStorage = {2, "int32"},
  LongStorage = {3, "int64"}, ByteStorage = {4, "uint8"}, BoolStorage = {5, "bool"},
  HalfStorage = {nil, "float16"}, BFloat16Storage = {nil, "bfloat16"}, CharStorage = {nil, "int8"},
  ShortStorage = {nil, "int16"}, ComplexHalfStorage = {nil, "complex32"}, ComplexFloatStorage = {nil, "complex64"},
  ComplexDoubleStorage = {nil, "complex128"}, QInt8Storage = {nil, "qint8"}, QUInt8Storage = {nil, "quint8"},
  QInt32Storage = {nil, "qint32"},
}
-- the storage class of each rpchost dtype id, for writing
local STORAGE_OF = {[0] = "FloatStorage", "DoubleStorage", "IntStorage", "LongStorage", "ByteStorage", "BoolStorage"}
M.STORAGE_OF = STORAGE_OF

-- the callables REDUCE and NEWOBJ may run, each a fixed constructor below
local CALLABLE = {
  ["collections.OrderedDict"] = "OrderedDict",
  ["torch._utils._rebuild_tensor_v2"] = "rebuild_tensor_v2",
  ["torch._utils._rebuild_tensor"] = "rebuild_tensor",
  ["torch._utils._rebuild_parameter"] = "rebuild_parameter",
  ["torch.nn.parameter.Parameter"] = "Parameter",
}
local ALLOWED = "collections.OrderedDict, torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter, " ..
  "torch.nn.parameter.Parameter and the torch.*Storage classes"

local NONE = setmetatable({}, {__tostring = function() return "None" end}) -- None while parsing
local TWO53 = 2 ^ 53

-- path[k] as Python writes it (sd['fc.weight'], sd['state'][0]), for errors
function M.subscript(path, k)
  if type(k) == "string" then return ("%s['%s']"):format(path, (k:gsub("[\\']", "\\%0"):gsub("\n", "\\n"))) end
  return ("%s[%s]"):format(path, tostring(k))
end

local function is_int(v) return type(v) == "number" and v == math.floor(v) and v > -TWO53 and v < TWO53 end

-- IEEE 754 doubles to and from their 8 big-endian bytes (BINFLOAT), in plain
-- arithmetic: exact for every double, and independent of the host's byte order
local function double_from_be(b1, b2, b3, b4, b5, b6, b7, b8)
  local sign = b1 >= 128 and -1 or 1
  local exp = (b1 % 128) * 16 + math.floor(b2 / 16)
  local mant = (((((b2 % 16) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6) * 65536 + b7 * 256 + b8
  if exp == 2047 then return mant == 0 and sign * math.huge or 0 / 0 end
  if exp == 0 then return sign * math.ldexp(mant, -1074) end -- (zero and subnormals)
  return sign * math.ldexp(mant + 2 ^ 52, exp - 1075)
end

local function double_to_be(x)
  if x ~= x then return "\127\248\0\0\0\0\0\0" end -- (NaN, as Python writes it)
  local sign = 0
  if x < 0 or (x == 0 and 1 / x < 0) then sign, x = 128, -x end
  local exp, mant
  if x == math.huge then exp, mant = 2047, 0
  elseif x == 0 then exp, mant = 0, 0
  else
    local m, e = math.frexp(x) -- x = m 2^e, 0.5 <= m < 1
    if e + 1022 >= 1 then exp, mant = e + 1022, (m * 2 - 1) * 2 ^ 52
    else exp, mant = 0, math.ldexp(x, 1074) end -- (subnormal)
  end
  local hi = math.floor(mant / 2 ^ 32) -- (the top 20 bits of the mantissa)
  local lo = mant - hi * 2 ^ 32
  return string.char(sign + math.floor(exp / 16), (exp % 16) * 16 + math.floor(hi / 65536),
    math.floor(hi / 256) % 256, hi % 256, math.floor(lo / 16777216), math.floor(lo / 65536) % 256,
    math.floor(lo / 256) % 256, lo % 256)
end
M._double_from_be, M._double_to_be = double_from_be, double_to_be -- (for the spec)

-- loads(s, ctx) -> value. ctx.what prefixes every error ("nn.load: m.pt:
-- data.pkl"); ctx.storage(info) is called once per storage key with {key,
-- dtype (rpchost id or nil), dtype_name, class, location, numel} and returns a
-- handle; ctx.tensor(handle, info, view, path) makes the tensor of a view
-- {offset, size, stride, requires_grad} (path: where it sits, "sd['fc.weight']");
-- ctx.order, when given, records each dict's key order (a weak table).
function M.loads(s, ctx)
  local n, pos = #s, 1
  local op_at = 1 -- where the opcode being run starts, for errors
  local kind = {} -- our tables -> "list" | "tuple" | "dict" | "OrderedDict" | "set" | "global" | "tensor" | "storage"
  local keys = {} -- dict -> its keys in insertion order
  local stack, sp = {}, 0
  local marks, nmarks = {}, 0
  local memo, nmemo = {}, 0 -- (nmemo: the entries written, where MEMOIZE puts the next)
  local storages = {} -- key -> storage descriptor
  local globals = {} -- full name -> global descriptor

  local function fail(fmt, ...)
    error(("%s: %s (at byte %d)"):format(ctx.what, fmt:format(...), op_at - 1), 0)
  end

  local function need(k, what)
    if k < 0 or pos + k - 1 > n then fail("the pickle ends inside %s (%d more bytes needed)", what, k - (n - pos + 1)) end
  end
  local function u8() need(1, "an argument"); pos = pos + 1; return s:byte(pos - 1) end
  local function uint(k)
    need(k, "an argument")
    local v = 0
    for i = k - 1, 0, -1 do v = v * 256 + s:byte(pos + i) end
    pos = pos + k
    return v
  end
  local function bytes(k, what)
    if k >= TWO53 then fail("%s of %.0f bytes", what, k) end
    need(k, what)
    pos = pos + k
    return s:sub(pos - k, pos - 1)
  end
  local function line(what)
    local e = s:find("\n", pos, true)
    if not e then fail("the pickle ends inside %s", what) end
    local v = s:sub(pos, e - 1)
    pos = e + 1
    return v
  end

  local function push(v) sp = sp + 1; stack[sp] = v end
  local function pop(what)
    if sp == 0 or (nmarks > 0 and sp <= marks[nmarks]) then fail("%s finds the stack empty", what) end
    local v = stack[sp]
    stack[sp] = nil
    sp = sp - 1
    return v
  end
  local function top(what)
    if sp == 0 or (nmarks > 0 and sp <= marks[nmarks]) then fail("%s finds the stack empty", what) end
    return stack[sp]
  end
  -- the items pushed since the last MARK, as an array, and the count
  local function pop_mark(what)
    if nmarks == 0 then fail("%s without a MARK before it", what) end
    local m = marks[nmarks]
    marks[nmarks] = nil
    nmarks = nmarks - 1
    local items, k = {}, 0
    for i = m + 1, sp do k = k + 1; items[k] = stack[i]; stack[i] = nil end
    sp = m
    return items, k
  end

  local function new(k, t)
    t = t or {}
    kind[t] = k
    if k == "dict" or k == "OrderedDict" then keys[t] = {} end
    return t
  end
  local function describe(v)
    if v == NONE then return "None" end
    if type(v) == "table" then
      local k = kind[v]
      if k == "global" then return v.name end
      return k or "table"
    end
    return type(v)
  end

  local function setitem(d, k, v)
    local dk = kind[d]
    if dk ~= "dict" and dk ~= "OrderedDict" then
      fail("%s on a %s: only dicts take items", NAMES[s:byte(op_at)], describe(d))
    end
    if type(k) == "cdata" then
      if k < -TWO53 or k > TWO53 then fail("a dict key (%s) too large for a Lua table key", tostring(k)) end
      k = tonumber(k)
    end
    if type(k) == "number" then
      if k ~= k then fail("a dict key that is NaN") end
    elseif type(k) ~= "string" and type(k) ~= "boolean" then
      fail("a dict key that is a %s (only strings, numbers and booleans can be Lua table keys)", describe(k))
    end
    if d[k] == nil then local ks = keys[d]; ks[#ks + 1] = k end
    d[k] = v
  end

  local function global(module, name)
    local full = module .. "." .. name
    local g = globals[full]
    if g then return g end
    local role = CALLABLE[full]
    local cls = (module == "torch" or module == "torch.cuda") and name:match("^(%w+Storage)$")
    if not role and not cls then
      -- (a class of a model or of torch: what torch.save(model) writes, not a state_dict)
      local hint = (module:match("^torch") or module:match("^__main__") or module:match("^__torch__")) and
        "; in PyTorch, save model.state_dict() (not the model) with torch.save and load that" or ""
      fail("global %s is not allowed: a state_dict's pickle may name only %s%s", full, ALLOWED, hint)
    end
    g = new("global", {name = full, role = role or "storage"})
    if cls then
      local d = STORAGE_DTYPES[cls]
      g.dtype, g.dtype_name = d and d[1], d and d[2] or cls:gsub("Storage$", "")
    end
    globals[full] = g
    return g
  end

  local function int_arg(v, what)
    if not is_int(v) or v < 0 then
      fail("%s must be a non-negative integer below 2^53, got %s", what,
        (type(v) == "number" or type(v) == "cdata") and tostring(v) or describe(v))
    end
    return v
  end
  local function int_tuple(v, what)
    local k = kind[v]
    if k ~= "tuple" and k ~= "list" then fail("%s must be a tuple of integers, got a %s", what, describe(v)) end
    if #v > 16 then fail("%s has %d dimensions (at most 16)", what, #v) end
    local out = {}
    for i = 1, #v do out[i] = int_arg(v[i], what) end
    return out
  end

  -- ('storage', class, key, location, numel): one storage of the archive
  local function persistent(pid)
    if kind[pid] ~= "tuple" then fail("a persistent id must be a tuple, got a %s", describe(pid)) end
    if pid[1] ~= "storage" then
      fail("persistent id %s: only ('storage', ...) ids are allowed",
        type(pid[1]) == "string" and ("'" .. pid[1] .. "'") or describe(pid[1]))
    end
    if #pid ~= 5 then fail("a storage's persistent id has %d items (5 expected)", #pid) end
    local cls, key, location, numel = pid[2], pid[3], pid[4], pid[5]
    if kind[cls] ~= "global" or cls.role ~= "storage" then
      fail("a storage's class must be a torch.*Storage, got %s", describe(cls))
    end
    if type(key) == "number" and is_int(key) then key = ("%d"):format(key) end
    if type(key) ~= "string" then fail("a storage key must be a string, got a %s", describe(key)) end
    if type(location) ~= "string" then fail("a storage location must be a string, got a %s", describe(location)) end
    int_arg(numel, "a storage's element count")
    local st = storages[key]
    if st then
      if st.info.class ~= cls.name or st.info.numel ~= numel then
        fail("storage '%s' is named twice with different types or sizes (%s of %d, %s of %d)", key, st.info.class,
          st.info.numel, cls.name, numel)
      end
      return st
    end
    local info = {key = key, dtype = cls.dtype, dtype_name = cls.dtype_name, class = cls.name, location = location,
                  numel = numel}
    st = new("storage", {info = info, handle = ctx.storage(info)})
    storages[key] = st
    return st
  end

  local function tensor_of(storage, offset, size, stride, requires_grad)
    if kind[storage] ~= "storage" then
      fail("a tensor's storage must come from a persistent id, got a %s", describe(storage))
    end
    local view = {offset = int_arg(offset, "a tensor's storage offset"), size = int_tuple(size, "a tensor's size"),
                  stride = int_tuple(stride, "a tensor's stride")}
    if #view.size ~= #view.stride then fail("a tensor has %d sizes but %d strides", #view.size, #view.stride) end
    if requires_grad ~= nil and type(requires_grad) ~= "boolean" then fail("requires_grad must be a bool") end
    view.requires_grad = requires_grad == true
    return new("tensor", {storage = storage, view = view})
  end

  -- REDUCE and NEWOBJ: the fixed constructor of an allowed callable
  local function call(f, args, opn)
    if kind[f] ~= "global" or f.role == "storage" then
      fail("%s of %s: only %s can be called", opn, describe(f), ALLOWED)
    end
    if kind[args] ~= "tuple" then
      fail("%s of %s with arguments that are a %s, not a tuple", opn, f.name, describe(args))
    end
    local role = f.role
    if opn == "NEWOBJ" and role ~= "Parameter" then
      fail("NEWOBJ of %s: only torch.nn.parameter.Parameter can be instantiated", f.name)
    end
    if role == "OrderedDict" then
      if #args ~= 0 then
        fail("OrderedDict called with %d arguments (a state_dict's is built empty, then filled)", #args)
      end
      return new("OrderedDict")
    elseif role == "rebuild_tensor_v2" then
      if #args ~= 6 and #args ~= 7 then fail("_rebuild_tensor_v2 takes 6 or 7 arguments, got %d", #args) end
      if kind[args[6]] ~= "OrderedDict" and kind[args[6]] ~= "dict" then
        fail("_rebuild_tensor_v2's backward hooks must be an OrderedDict")
      end
      return tensor_of(args[1], args[2], args[3], args[4], args[5])
    elseif role == "rebuild_tensor" then
      if #args ~= 4 then fail("_rebuild_tensor takes 4 arguments, got %d", #args) end
      return tensor_of(args[1], args[2], args[3], args[4], false)
    elseif role == "rebuild_parameter" or role == "Parameter" then
      local data, rg = args[1], args[2]
      if kind[data] ~= "tensor" then fail("%s of a %s, not a tensor", f.name, describe(data)) end
      if rg == nil or rg == NONE then rg = true end
      if type(rg) ~= "boolean" then fail("%s: requires_grad must be a bool", f.name) end
      local view = {}
      for k, v in pairs(data.view) do view[k] = v end
      view.requires_grad = rg
      return new("tensor", {storage = data.storage, view = view})
    end
    fail("%s of %s is not allowed", opn, f.name)
  end

  local function decode_long(b)
    local k = #b
    if k == 0 then return 0 end
    if k > 8 then fail("an integer of %d bytes (at most 64 bits are read)", k) end
    local v = 0LL
    for i = k, 1, -1 do v = v * 256 + b:byte(i) end
    if k < 8 and b:byte(k) >= 128 then v = v - bit.lshift(1LL, 8 * k) end
    if v >= -TWO53 and v <= TWO53 then return tonumber(v) end
    return v
  end

  local OPS = {}
  OPS[0x80] = function() -- PROTO
    local v = u8()
    if v > 5 then fail("pickle protocol %d (at most 5 is read)", v) end
  end
  OPS[0x95] = function() uint(8) end -- FRAME: a length hint, nothing to build
  OPS[0x28] = function() nmarks = nmarks + 1; marks[nmarks] = sp end -- MARK
  OPS[0x29] = function() push(new("tuple")) end
  OPS[0x5d] = function() push(new("list")) end
  OPS[0x7d] = function() push(new("dict")) end
  OPS[0x8f] = function() push(new("set")) end
  OPS[0x74] = function() push(new("tuple", (pop_mark("TUPLE")))) end
  OPS[0x85] = function() push(new("tuple", {pop("TUPLE1")})) end
  OPS[0x86] = function() local b = pop("TUPLE2"); push(new("tuple", {pop("TUPLE2"), b})) end
  OPS[0x87] = function()
    local c = pop("TUPLE3")
    local b = pop("TUPLE3")
    push(new("tuple", {pop("TUPLE3"), b, c}))
  end
  OPS[0x4e] = function() push(NONE) end
  OPS[0x88] = function() push(true) end
  OPS[0x89] = function() push(false) end
  OPS[0x4a] = function() local v = uint(4); push(v >= 2 ^ 31 and v - 2 ^ 32 or v) end -- BININT
  OPS[0x4b] = function() push(u8()) end -- BININT1
  OPS[0x4d] = function() push(uint(2)) end -- BININT2
  OPS[0x8a] = function() push(decode_long(bytes(u8(), "LONG1"))) end
  OPS[0x8b] = function() push(decode_long(bytes(uint(4), "LONG4"))) end
  OPS[0x47] = function() -- BINFLOAT: a big-endian double
    need(8, "BINFLOAT")
    pos = pos + 8
    push(double_from_be(s:byte(pos - 8, pos - 1)))
  end
  OPS[0x58] = function() push(bytes(uint(4), "BINUNICODE")) end
  OPS[0x8c] = function() push(bytes(u8(), "SHORT_BINUNICODE")) end
  OPS[0x8d] = function() push(bytes(uint(8), "BINUNICODE8")) end
  OPS[0x55] = function() push(bytes(u8(), "SHORT_BINSTRING")) end
  OPS[0x54] = function() push(bytes(uint(4), "BINSTRING")) end
  OPS[0x43] = function() push(bytes(u8(), "SHORT_BINBYTES")) end
  OPS[0x42] = function() push(bytes(uint(4), "BINBYTES")) end
  OPS[0x8e] = function() push(bytes(uint(8), "BINBYTES8")) end
  local function put(i)
    if memo[i] == nil then nmemo = nmemo + 1 end
    memo[i] = top("a memo PUT")
  end
  local function get(i)
    local v = memo[i]
    if v == nil then fail("memo entry %d is read before it is written", i) end
    push(v)
  end
  OPS[0x71] = function() put(u8()) end -- BINPUT
  OPS[0x72] = function() put(uint(4)) end -- LONG_BINPUT
  OPS[0x94] = function() put(nmemo) end -- MEMOIZE: into the next index, as Python counts them
  OPS[0x68] = function() get(u8()) end -- BINGET
  OPS[0x6a] = function() get(uint(4)) end -- LONG_BINGET
  OPS[0x63] = function() -- GLOBAL
    local module = line("GLOBAL's module")
    push(global(module, line("GLOBAL's name")))
  end
  OPS[0x93] = function() -- STACK_GLOBAL
    local name = pop("STACK_GLOBAL")
    local module = pop("STACK_GLOBAL")
    if type(module) ~= "string" or type(name) ~= "string" then
      fail("STACK_GLOBAL of a %s and a %s", describe(module), describe(name))
    end
    push(global(module, name))
  end
  OPS[0x52] = function() -- REDUCE
    local args = pop("REDUCE")
    push(call(pop("REDUCE"), args, "REDUCE"))
  end
  OPS[0x81] = function() -- NEWOBJ
    local args = pop("NEWOBJ")
    push(call(pop("NEWOBJ"), args, "NEWOBJ"))
  end
  OPS[0x51] = function() push(persistent(pop("BINPERSID"))) end -- BINPERSID
  OPS[0x62] = function() -- BUILD: only an OrderedDict's attributes (_metadata), which Lua has no place for
    local state = pop("BUILD")
    local inst = top("BUILD")
    if kind[inst] ~= "OrderedDict" then
      fail("BUILD on a %s: only an OrderedDict's attributes may be set", describe(inst))
    end
    if kind[state] ~= "dict" and state ~= NONE then
      fail("BUILD with a %s as the state (a dict expected)", describe(state))
    end
  end
  OPS[0x61] = function() -- APPEND
    local v = pop("APPEND")
    local l = top("APPEND")
    if kind[l] ~= "list" then fail("APPEND to a %s: only lists can be appended to", describe(l)) end
    l[#l + 1] = v
  end
  OPS[0x65] = function() -- APPENDS
    local items, k = pop_mark("APPENDS")
    local l = top("APPENDS")
    if kind[l] ~= "list" then fail("APPENDS to a %s: only lists can be extended", describe(l)) end
    local m = #l
    for i = 1, k do l[m + i] = items[i] end
  end
  OPS[0x73] = function() -- SETITEM
    local v = pop("SETITEM")
    local k = pop("SETITEM")
    setitem(top("SETITEM"), k, v)
  end
  OPS[0x75] = function() -- SETITEMS
    local items, k = pop_mark("SETITEMS")
    if k % 2 ~= 0 then fail("SETITEMS with an odd number of items (%d)", k) end
    local d = top("SETITEMS")
    for i = 1, k, 2 do setitem(d, items[i], items[i + 1]) end
  end
  OPS[0x90] = function() -- ADDITEMS
    local items, k = pop_mark("ADDITEMS")
    local set = top("ADDITEMS")
    if kind[set] ~= "set" then fail("ADDITEMS to a %s: only sets take them", describe(set)) end
    for i = 1, k do
      local v = items[i]
      if type(v) == "table" or v ~= v then fail("a set element that is a %s", describe(v)) end
      set[v] = true
    end
  end

  local result
  OPS[0x2e] = function() -- STOP
    result = pop("STOP")
  end

  while result == nil do
    if pos > n then fail("the pickle ends without STOP") end
    op_at = pos
    local op = s:byte(pos)
    pos = pos + 1
    local f = OPS[op]
    if not f then
      fail("opcode %s is not allowed: a state_dict's pickle uses only the opcodes of PyTorch's weights_only " ..
        "unpickler, none that builds arbitrary objects", opname(op))
    end
    f()
  end
  if sp ~= 0 or nmarks ~= 0 then fail("STOP leaves %d values on the stack", sp) end

  -- The walk from parsed values to the caller's: None becomes nil, tensors are
  -- made (once each: a tensor referenced twice is one tensor), dicts are marked
  -- and their key order recorded. A table reached twice (memo) is one table.
  local done = {}
  local function conv(v, path, depth)
    if v == NONE then return nil end
    if type(v) ~= "table" then return v end
    if done[v] ~= nil then return done[v] end
    local k = kind[v]
    if k == "tensor" then
      local t = ctx.tensor(v.storage.handle, v.storage.info, v.view, path)
      done[v] = t
      return t
    end
    if k == "global" or k == "storage" then
      fail("%s is %s, which is not a value a state_dict holds", path, k == "global" and v.name or "a bare storage")
    end
    if depth > 200 then fail("%s is nested more than 200 containers deep", path) end
    done[v] = v -- converted in place: the parsed tables are our own
    if k == "list" or k == "tuple" then
      local len = #v
      for i = 1, len do v[i] = conv(v[i], M.subscript(path, i - 1), depth + 1) end
    elseif k == "dict" or k == "OrderedDict" then
      local order = {}
      for _, key in ipairs(keys[v]) do
        local x = conv(v[key], M.subscript(path, key), depth + 1)
        v[key] = x
        if x ~= nil then order[#order + 1] = key end
      end
      mapping.mark(v, k)
      if ctx.order then ctx.order[v] = order end
    end
    return v
  end
  return conv(result, ctx.root or "sd", 0)
end

-- Writing ----------------------------------------------------------------

local function u32(v)
  return string.char(v % 256, math.floor(v / 256) % 256, math.floor(v / 65536) % 256, math.floor(v / 16777216) % 256)
end

-- valid UTF-8 (what Python's str holds; BINUNICODE is decoded as UTF-8)
local function is_utf8(s)
  if not s:find("[\128-\255]") then return true end
  local i, n = 1, #s
  while i <= n do
    local c = s:byte(i)
    local k = c < 0x80 and 0 or (c >= 0xc2 and c < 0xe0) and 1 or (c >= 0xe0 and c < 0xf0) and 2 or
      (c >= 0xf0 and c < 0xf5) and 3 or nil
    if not k or i + k > n then return false end
    for j = i + 1, i + k do
      local d = s:byte(j)
      if d < 0x80 or d > 0xbf then return false end
    end
    i = i + k + 1
  end
  return true
end

-- the keys of t written as a dict, in order: the recorded order first (those
-- still present), then the rest sorted (numbers, then strings, then booleans)
local RANKS = {number = 1, string = 2, boolean = 3}
local function dict_keys(t, order)
  local out, seen = {}, {}
  for _, k in ipairs(order or {}) do
    if t[k] ~= nil and not seen[k] then out[#out + 1] = k; seen[k] = true end
  end
  local rest = {}
  for k in pairs(t) do if not seen[k] then rest[#rest + 1] = k end end
  table.sort(rest, function(a, b)
    local ra, rb = RANKS[type(a)] or 4, RANKS[type(b)] or 4
    if ra ~= rb then return ra < rb end
    if ra == 3 then return (not a) and b end
    if ra == 4 then return tostring(a) < tostring(b) end
    return a < b
  end)
  for _, k in ipairs(rest) do out[#out + 1] = k end
  return out
end

local function is_list(t)
  local n = #t
  if n == 0 then return false end
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  return count == n
end

-- dumps(value, ctx) -> the bytes of a protocol-2 pickle. ctx.what prefixes
-- errors; ctx.tensor_ref(t, path) -> {class, key, location, numel, offset, size,
-- stride, requires_grad} places a tensor in a storage; ctx.order is the key-order
-- registry (tables in it are OrderedDicts); ctx.is_tensor tells tensors apart.
function M.dumps(root, ctx)
  local out, n = {}, 0
  local function w(s) n = n + 1; out[n] = s end
  local memo, nmemo = {}, 0
  local function fail(fmt, ...) error(("%s: %s"):format(ctx.what, fmt:format(...)), 0) end

  -- a memo slot for objects written more than once (globals, tensors)
  local function put(obj)
    memo[obj] = nmemo
    if nmemo < 256 then w("q" .. string.char(nmemo)) else w("r" .. u32(nmemo)) end
    nmemo = nmemo + 1
  end
  local function get(obj)
    local i = memo[obj]
    if i == nil then return false end
    if i < 256 then w("h" .. string.char(i)) else w("j" .. u32(i)) end
    return true
  end
  local function global(module, name)
    local full = module .. "\n" .. name .. "\n"
    if get(full) then return end
    w("c" .. full)
    put(full)
  end

  local function int(v)
    if v >= 0 and v < 256 then w("K" .. string.char(v))
    elseif v >= 0 and v < 65536 then w("M" .. string.char(v % 256, math.floor(v / 256)))
    elseif v >= -2 ^ 31 and v < 2 ^ 31 then w("J" .. u32(v < 0 and v + 2 ^ 32 or v))
    else
      -- LONG1: little-endian two's complement, as few bytes as keep the sign
      local x = type(v) == "cdata" and v or ffi.new("int64_t", v)
      local b = {}
      for i = 1, 8 do b[i] = tonumber(bit.band(bit.rshift(x, 8 * (i - 1)), 0xff)) end
      local k = 8
      while k > 1 and ((b[k] == 0 and b[k - 1] < 128) or (b[k] == 255 and b[k - 1] >= 128)) do k = k - 1 end
      w("\138" .. string.char(k) .. string.char(unpack(b, 1, k)))
    end
  end
  local function number(v)
    if is_int(v) then return int(v) end
    w("G" .. double_to_be(v))
  end
  local function str(v, path)
    if not is_utf8(v) then fail("%s is a string that is not UTF-8, which a Python str cannot hold", path) end
    w("X" .. u32(#v) .. v)
  end
  local function int_tuple(list)
    if #list == 0 then return w(")") end
    if #list > 3 then w("(") end
    for _, v in ipairs(list) do int(v) end
    w(#list == 1 and "\133" or #list == 2 and "\134" or #list == 3 and "\135" or "t")
  end

  local function tensor(t, path)
    if get(t) then return end
    local r = ctx.tensor_ref(t, path)
    global("torch._utils", "_rebuild_tensor_v2")
    w("((")
    str("storage")
    global("torch", r.class)
    str(r.key)
    str(r.location)
    int(r.numel)
    w("tQ") -- the persistent id, loaded by the reader as a storage
    int(r.offset)
    int_tuple(r.size)
    int_tuple(r.stride)
    w(r.requires_grad and "\136" or "\137")
    global("collections", "OrderedDict")
    w(")R") -- the backward hooks: an empty OrderedDict
    w("tR")
    put(t)
  end

  local open = {} -- tables on the current path, to refuse cycles
  local function value(v, path)
    local tv = type(v)
    if v == nil then return w("N") end
    if tv == "boolean" then return w(v and "\136" or "\137") end
    if tv == "number" then return number(v) end
    if tv == "string" then return str(v, path) end
    if tv == "cdata" and (ffi.istype("int64_t", v) or ffi.istype("uint64_t", v)) then
      if ffi.istype("uint64_t", v) and v >= 2 ^ 63 then fail("%s is %s, past int64", path, tostring(v)) end
      local x = ffi.new("int64_t", v)
      if x > -TWO53 and x < TWO53 then return int(tonumber(x)) end
      return int(x)
    end
    if ctx.is_tensor(v) then return tensor(v, path) end
    if tv ~= "table" or getmetatable(v) ~= nil then
      fail("%s is a %s, which a .pt file cannot hold (tensors, numbers, strings, booleans and tables of them)", path,
        tv == "table" and "table with a metatable (an object)" or tv)
    end
    if open[v] then fail("%s contains itself (a cycle)", path) end
    open[v] = true
    local order = ctx.order and ctx.order[v]
    local kindv = mapping.kind(v)
    if not kindv and not order and is_list(v) then
      w("](")
      for i = 1, #v do
        value(v[i], M.subscript(path, i))
        if i % 1000 == 0 and i < #v then w("e(") end -- batches of 1000, as Python's pickler writes
      end
      w("e")
    else
      if kindv == "OrderedDict" or (kindv == nil and order) then
        global("collections", "OrderedDict")
        w(")R")
      else
        w("}")
      end
      local ks = dict_keys(v, order)
      w("(")
      for i, k in ipairs(ks) do
        local tk = type(k)
        local kp = M.subscript(path, k)
        if tk == "string" then str(k, kp)
        elseif tk == "number" then number(k)
        elseif tk == "boolean" then w(k and "\136" or "\137")
        else fail("%s has a key that is a %s (Python dict keys here: strings, numbers, booleans)", path, tk) end
        value(v[k], kp)
        if i % 1000 == 0 and i < #ks then w("u(") end
      end
      w("u")
    end
    open[v] = nil
  end

  w("\128\2")
  value(root, ctx.root or "sd")
  w(".")
  return table.concat(out)
end

return M
