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
--  * README.md and docs/ link only to files that exist in the repository.
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

describe("the documentation #world", function()
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

describe("the documentation #unit", function()
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
