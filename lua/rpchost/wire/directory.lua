-- rpchost.wire.directory: a world's static ranks in one string, read a rank at a time.
--
-- The rank that completes a rendezvous builds the directory from every rank's
-- record, and every rank of the world reads it, once per agent (the process
-- group's and RPC's). Decoded whole, the directory of 1,024 ranks was some 5,000
-- Lua values (126 us per agent per rank, and as much again for the collector),
-- yet a rank talks to a few peers. So the string keeps each rank's address
-- encoded on its own, with their offsets: one is decoded the first time its rank
-- is looked up, and the names (an array of their own) when a name is.
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"

local M = {}
local Dir = {}
Dir.__index = Dir

-- (offsets are 4-byte big-endian numbers: the directory may be read on another
-- host than the one that wrote it)
local function be32(n)
  return string.char(math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
                     math.floor(n / 256) % 256, n % 256)
end

local function offset_at(s, i)
  local a, b, c, d = s:byte(4 * i + 1, 4 * i + 4)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

-- The directory of a world from every rank's record (codec-encoded, rank r's at
-- r + 1): a string, or nil and what is wrong; check(record), when given, says
-- what is wrong with one record (a version mismatch, say); host_key(host), when
-- given, the key of the host a record's advertised host stands for (nil when
-- it cannot tell): ranks with one key share a host (Dir:host_index), so every
-- rank reads the world's hosts without decoding every record.
function M.build(recs, check, host_key)
  local names, recs_out, offsets, at = {}, {}, {be32(0)}, 0
  local host_ids, by_key, nhosts = {}, {}, 0
  for i, raw in ipairs(recs) do
    local ok, w = pcall(codec.decode, raw)
    local bad = ("the store holds a malformed record for rank %d"):format(i - 1)
    if not ok or type(w) ~= "table" or type(w.name) ~= "string" or w.rank ~= i - 1 then return nil, bad end
    -- (the caller's check first: another rpchost version's record is named so)
    local why = check and check(w)
    if why then return nil, why end
    if type(w.ip) ~= "string" or type(w.port) ~= "number" or (w.unix ~= nil and type(w.unix) ~= "string") or
        (w.host ~= nil and type(w.host) ~= "string") then
      return nil, bad
    end
    names[i] = w.name
    -- (what a peer needs to reach this rank, and which host and namespaces it
    -- is in, for the same-host paths: rpchost.net.hosts; the rank is its place)
    local rec = codec.raw_encode("peer", w.name, w.ip, w.port, w.unix or false, tonumber(w.incarnation) or 0,
      w.host or false)
    recs_out[i] = rec
    at = at + #rec
    offsets[i + 1] = be32(at)
    local k = host_key and w.host and host_key(w.host)
    local id = 0 -- (unknown)
    if k then
      id = by_key[k]
      if not id then nhosts = nhosts + 1; id = nhosts; by_key[k] = id end
    end
    host_ids[i] = string.char(math.floor(id / 256) % 256, id % 256)
  end
  return codec.raw_encode("directory", {n = #recs, offsets = table.concat(offsets),
    records = table.concat(recs_out), names = codec.raw_encode("names", names),
    hosts = host_key and table.concat(host_ids) or nil, nhosts = host_key and nhosts or nil})
end

local function malformed(what)
  error(errors.new("protocol", "the world's directory at the store is malformed (" .. what .. ")"), 0)
end

-- Reads a directory (M.build's string) for a world of world_size ranks; raises
-- a "protocol" error naming what is wrong when it is not one.
function M.open(raw, world_size)
  local ok, d = pcall(codec.raw_decode, raw)
  if not ok or type(d) ~= "table" or type(d.n) ~= "number" or type(d.offsets) ~= "string" or
      type(d.records) ~= "string" or type(d.names) ~= "string" then
    malformed("not a directory")
  end
  if d.n ~= world_size then
    malformed(("%s ranks for a world of %d"):format(tostring(d.n), world_size))
  end
  -- (every offset, once: a record is then always its own rank's bytes; 4 KB
  -- of reads for 1,024 ranks)
  local offsets = d.offsets
  if #offsets ~= 4 * (d.n + 1) or offset_at(offsets, 0) ~= 0 or offset_at(offsets, d.n) ~= #d.records then
    malformed("its offsets do not match its records")
  end
  local prev = 0
  for i = 1, d.n do
    local at = offset_at(offsets, i)
    if at <= prev then malformed(("rank %d's record is empty or out of order"):format(i - 1)) end
    prev = at
  end
  -- (the hosts, where the builder said them: two bytes per rank)
  local hosts = d.hosts
  if hosts ~= nil and (type(hosts) ~= "string" or #hosts ~= 2 * d.n or type(d.nhosts) ~= "number") then
    malformed("its hosts do not match its ranks")
  end
  return setmetatable({n = d.n, offsets = d.offsets, records = d.records, names_raw = d.names,
                       hosts = hosts, nhosts = hosts and d.nhosts or nil}, Dir)
end

-- The index (1, 2, ...) of rank r's host among the world's hosts, in order of
-- their first rank; nil when unknown (the builder was given no host_key, or it
-- could not tell for that rank) or for a rank out of range. Dir.nhosts: how
-- many hosts the known ranks are on.
function Dir:host_index(r)
  local h = self.hosts
  if not h or type(r) ~= "number" or r < 0 or r >= self.n then return nil end
  local a, b = h:byte(2 * r + 1, 2 * r + 2)
  local id = a * 256 + b
  return id > 0 and id or nil
end

local function record(r, ok, name, ip, port, unix, incarnation, host, ...)
  if not ok or select("#", ...) > 0 or type(name) ~= "string" or type(ip) ~= "string" or type(port) ~= "number" or
      (unix ~= false and type(unix) ~= "string") or type(incarnation) ~= "number" or
      (host ~= false and type(host) ~= "string") then
    malformed(("rank %d's record"):format(r))
  end
  return {rank = r, name = name, ip = ip, port = port, unix = unix or nil, incarnation = incarnation,
          host = host or nil}
end

-- Rank r's record ({rank, name, ip, port, unix, incarnation, host}), decoded now (the
-- agent keeps what it makes of it); nil for a rank out of range.
function Dir:record(r)
  if type(r) ~= "number" or r < 0 or r >= self.n or r ~= math.floor(r) then return nil end
  local from, to = offset_at(self.offsets, r), offset_at(self.offsets, r + 1)
  return record(r, pcall(codec.raw_decode, self.records:sub(from + 1, to)))
end

-- Every rank's name, in rank order (decoded on first use).
function Dir:names()
  local names = self.names_list
  if not names then
    local ok, v = pcall(codec.raw_decode, self.names_raw)
    if not ok or type(v) ~= "table" or #v ~= self.n then malformed("its names") end
    for i = 1, self.n do
      if type(v[i]) ~= "string" then malformed(("rank %d's name"):format(i - 1)) end
    end
    names = v
    self.names_list = names
  end
  return names
end

-- The rank named `name`, or nil (the index is made on first use).
function Dir:rank_of(name)
  local index = self.index
  if not index then
    index = {}
    for i, n in ipairs(self:names()) do index[n] = i - 1 end
    self.index = index
  end
  return index[name]
end

return M
