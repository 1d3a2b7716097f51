-- rpchost.tools.plot: `rpchost plot LOGDIR [-o FILE] [--smoothing W] [--title T]`,
-- the curves of a SummaryWriter's event files as one self-contained HTML page
-- (inline SVG and CSS, no script, nothing fetched), for whoever has no
-- TensorBoard at hand. Every directory under LOGDIR holding event files is a
-- run, named by its path under LOGDIR (rank0, rank1, ..., or lr_train for an
-- add_scalars series), as TensorBoard names them; each tag gets one chart with
-- every run overlaid: the raw values faint, TensorBoard's smoothed curve over
-- them (its exponential moving average, debiased, weight 0.6 by default).
-- Histograms are drawn as TensorBoard's distributions are summarised: min-max
-- and mean +- one standard deviation per step; text as a table.
local tfevents = require "rpchost.tfevents"

local M = {}

M.USAGE = [[
usage: rpchost plot LOGDIR [-o FILE] [--smoothing W] [--title TEXT]

Draws the scalars (and histograms, and text) of the TensorBoard event files under
LOGDIR into one self-contained HTML page: one chart per tag, every run (each
directory holding event files: rank0, rank1, ...) overlaid, smoothed as TensorBoard
smooths (an exponential moving average with its debiasing).

  -o FILE          where to write the page (default: plot.html; - for stdout)
  --smoothing W    TensorBoard's smoothing weight, 0 (none) to 0.999 (default 0.6)
  --title TEXT     the page's title (default: LOGDIR)
]]

-- TensorBoard's palette, in its order
local COLORS = {"#425066", "#12b5cb", "#e52592", "#f9ab00", "#9334e6", "#7cb342", "#e8710a", "#1a73e8",
                "#d93025", "#188038"}
local MAX_POINTS = 2000 -- drawn per curve (smoothing sees every point)

local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local function read_all(path)
  local f, err = io.open(path, "rb")
  if not f then error(("rpchost plot: cannot read %s: %s"):format(path, tostring(err)), 0) end
  local s = f:read("*a")
  f:close()
  return s
end

-- the runs under logdir: {name, files = {paths, oldest first}}, by name
function M.runs(logdir)
  logdir = logdir:gsub("/+$", "")
  if logdir == "" then logdir = "/" end
  local p = io.popen(("find %s -type f -name 'events.out.tfevents.*' 2>/dev/null | sort"):format(shell_quote(logdir)))
  local by_dir, list = {}, {}
  for path in p:lines() do
    local dir = path:match("^(.*)/[^/]*$")
    local name = dir == logdir and (logdir:match("([^/]+)$") or logdir) or dir:sub(#logdir + 2)
    local run = by_dir[dir]
    if not run then
      run = {name = name, files = {}}
      by_dir[dir] = run
      list[#list + 1] = run
    end
    run.files[#run.files + 1] = path
  end
  p:close()
  -- (within a run the files' names start with their creation time: oldest first)
  for _, run in ipairs(list) do
    table.sort(run.files, function(a, b)
      local ta, tb = tonumber(a:match("tfevents%.(%d+)")) or 0, tonumber(b:match("tfevents%.(%d+)")) or 0
      if ta ~= tb then return ta < tb end
      return a < b
    end)
  end
  table.sort(list, function(a, b) return a.name < b.name end)
  return list
end

-- TensorBoard's smoothing (line_chart_v2's classicSmoothing): an exponential
-- moving average divided by 1 - w^n, so the first points are not pulled toward
-- zero; a constant series and non-finite points are left as they are
function M.smooth(values, w)
  local out, n = {}, #values
  local constant = true
  for i = 2, n do if values[i] ~= values[1] then constant = false; break end end
  local last, count = 0, 0
  for i = 1, n do
    local v = values[i]
    if constant or v ~= v or v == math.huge or v == -math.huge then
      out[i] = v
    else
      last = last * w + (1 - w) * v
      count = count + 1
      out[i] = w == 1 and last or last / (1 - w ^ count)
    end
  end
  return out
end

local function series(t, tag)
  local s = t[tag]
  if not s then
    s = {steps = {}, values = {}}
    t[tag] = s
  end
  return s
end

-- a session log START at step s: TensorBoard drops what the run logged at step
-- s or later before it (SummaryWriter's purge_step after a restart)
local function purge(run, step)
  for _, t in ipairs({run.scalars, run.hists, run.texts}) do
    for _, s in pairs(t) do
      local keep_steps, keep_values = {}, {}
      for i = 1, #s.steps do
        if s.steps[i] < step then
          keep_steps[#keep_steps + 1] = s.steps[i]
          keep_values[#keep_values + 1] = s.values[i]
        end
      end
      s.steps, s.values = keep_steps, keep_values
    end
  end
end

local function add_value(run, step, v)
  if v.simple_value then
    local s = series(run.scalars, v.tag)
    s.steps[#s.steps + 1], s.values[#s.values + 1] = step, v.simple_value
  elseif v.histo then
    local h = v.histo
    local num = h.num or 0
    if num > 0 then
      local mean = (h.sum or 0) / num
      local var = math.max((h.sum_squares or 0) / num - mean * mean, 0)
      local s = series(run.hists, v.tag)
      s.steps[#s.steps + 1] = step
      s.values[#s.values + 1] = {min = h.min or mean, max = h.max or mean, mean = mean, std = math.sqrt(var)}
    end
  elseif v.tensor and v.metadata and v.metadata.plugin_data and v.metadata.plugin_data.plugin_name == "text" then
    local s = series(run.texts, (v.tag:gsub("/text_summary$", "")))
    s.steps[#s.steps + 1] = step
    s.values[#s.values + 1] = table.concat(v.tensor.string_val or {}, "\n")
  end
end

-- reads a run's files: run.scalars / hists / texts = {[tag] = {steps, values}};
-- warnings (a file cut short at its end: its writer still writing, or killed)
-- go to run.warnings; a damaged file is an error naming it and where
function M.load(run)
  run.scalars, run.hists, run.texts, run.warnings = {}, {}, {}, {}
  for _, path in ipairs(run.files) do
    local events, tail = tfevents.events(read_all(path), path)
    if tail then run.warnings[#run.warnings + 1] = tail end
    for _, e in ipairs(events) do
      local step = tonumber(e.step or 0)
      if e.session_log and e.session_log.status == 1 then purge(run, step) end
      for _, v in ipairs(e.summary and e.summary.value or {}) do
        if v.tag then add_value(run, step, v) end
      end
    end
  end
  return run
end

-- drawing -----------------------------------------------------------------------
local function esc(s)
  return (tostring(s):gsub("[&<>\"']", {["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;", ['"'] = "&quot;",
                                         ["'"] = "&#39;"}))
end

local function finite(v) return v == v and v ~= math.huge and v ~= -math.huge end

local function num(v) return ("%.4g"):format(v) end

-- about n round tick values from lo to hi
local function ticks(lo, hi, n)
  local span = hi - lo
  local raw = span / n
  local mag = 10 ^ math.floor(math.log10(raw))
  local step = mag
  for _, m in ipairs({1, 2, 5, 10}) do
    step = m * mag
    if span / step <= n then break end
  end
  local out = {}
  for v = math.ceil(lo / step) * step, hi + step * 1e-9, step do out[#out + 1] = v end
  return out
end

local W, H, ML, MR, MT, MB = 760, 300, 70, 20, 14, 34

-- the chart frame for x in [x0, x1] and y in [y0, y1]: the SVG's opening, the
-- axes and grid, and the functions from data to pixels
local function frame(x0, x1, y0, y1)
  if x1 == x0 then x0, x1 = x0 - 1, x1 + 1 end
  if y1 == y0 then y0, y1 = y0 - 1, y1 + 1 else
    local pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
  end
  local function px(x) return ML + (x - x0) / (x1 - x0) * (W - ML - MR) end
  local function py(y) return MT + (y1 - y) / (y1 - y0) * (H - MT - MB) end
  local out = {("<svg viewBox=\"0 0 %d %d\" width=\"%d\" height=\"%d\" role=\"img\">"):format(W, H, W, H)}
  for _, v in ipairs(ticks(y0, y1, 5)) do
    local y = py(v)
    out[#out + 1] = ("<line class=\"grid\" x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\"/>"):format(ML, W - MR, y, y)
    out[#out + 1] = ("<text class=\"tick\" x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>"):format(ML - 6, y + 4,
      num(v))
  end
  for _, v in ipairs(ticks(x0, x1, 8)) do
    local x = px(v)
    out[#out + 1] = ("<line class=\"grid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\"/>"):format(x, x, MT, H - MB)
    out[#out + 1] = ("<text class=\"tick\" x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>"):format(x,
      H - MB + 16, num(v))
  end
  out[#out + 1] = ("<rect class=\"axes\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\"/>"):format(ML, MT, W - ML - MR,
    H - MT - MB)
  return out, px, py
end

-- an SVG path through the points (xs[i], ys[i]) at most MAX_POINTS of them; a
-- non-finite y breaks the line
local function path_d(xs, ys, px, py)
  local n = #xs
  local every = math.max(1, math.ceil(n / MAX_POINTS))
  local d, pen = {}, false
  for i = 1, n do
    if (i - 1) % every == 0 or i == n then
      local y = ys[i]
      if finite(y) then
        d[#d + 1] = ("%s%.1f,%.1f"):format(pen and "L" or "M", px(xs[i]), py(y))
        pen = true
      else
        pen = false
      end
    end
  end
  return table.concat(d, " ")
end

local function bounds(list, lo, hi)
  for _, v in ipairs(list) do
    if finite(v) then
      if v < lo then lo = v end
      if v > hi then hi = v end
    end
  end
  return lo, hi
end

local function legend(entries)
  local out = {"<div class=\"legend\">"}
  for _, e in ipairs(entries) do
    out[#out + 1] = ("<span><i style=\"background:%s\"></i>%s</span>"):format(e.color, esc(e.run))
  end
  out[#out + 1] = "</div>"
  return table.concat(out)
end

local function scalar_chart(tag, runs, colors, w)
  local x0, x1, y0, y1 = math.huge, -math.huge, math.huge, -math.huge
  local drawn = {}
  for _, run in ipairs(runs) do
    local s = run.scalars[tag]
    if s and #s.steps > 0 then
      x0, x1 = bounds(s.steps, x0, x1)
      y0, y1 = bounds(s.values, y0, y1)
      drawn[#drawn + 1] = {run = run.name, s = s, color = colors[run.name]}
    end
  end
  if #drawn == 0 then return nil end
  if y0 > y1 then y0, y1 = 0, 0 end -- (nothing finite: an empty frame)
  local out, px, py = frame(x0, x1, y0, y1)
  for _, e in ipairs(drawn) do
    local attrs = ("data-run=\"%s\" data-tag=\"%s\" stroke=\"%s\""):format(esc(e.run), esc(tag), e.color)
    if w > 0 then
      out[#out + 1] = ("<path class=\"raw\" %s d=\"%s\"/>"):format(attrs, path_d(e.s.steps, e.s.values, px, py))
    end
    local last = e.s.values[#e.s.values]
    out[#out + 1] = ("<path class=\"smoothed\" %s d=\"%s\"><title>%s: %s at step %s</title></path>"):format(attrs,
      path_d(e.s.steps, w > 0 and M.smooth(e.s.values, w) or e.s.values, px, py), esc(e.run), num(last),
      num(e.s.steps[#e.s.steps]))
  end
  out[#out + 1] = "</svg>"
  return ("<section><h2>%s</h2>%s%s</section>"):format(esc(tag), table.concat(out), legend(drawn))
end

-- a band between lo(v) and hi(v) over the steps, as one closed path
local function band_d(steps, values, lo, hi, px, py)
  local every = math.max(1, math.ceil(#steps / MAX_POINTS))
  local top, bottom = {}, {}
  for i = 1, #steps do
    if (i - 1) % every == 0 or i == #steps then
      top[#top + 1] = ("%.1f,%.1f"):format(px(steps[i]), py(hi(values[i])))
      table.insert(bottom, 1, ("%.1f,%.1f"):format(px(steps[i]), py(lo(values[i]))))
    end
  end
  return "M" .. table.concat(top, " L") .. " L" .. table.concat(bottom, " L") .. " Z"
end

local function histogram_chart(tag, runs, colors)
  local x0, x1, y0, y1 = math.huge, -math.huge, math.huge, -math.huge
  local drawn = {}
  for _, run in ipairs(runs) do
    local s = run.hists[tag]
    if s and #s.steps > 0 then
      x0, x1 = bounds(s.steps, x0, x1)
      for _, h in ipairs(s.values) do y0, y1 = bounds({h.min, h.max}, y0, y1) end
      drawn[#drawn + 1] = {run = run.name, s = s, color = colors[run.name]}
    end
  end
  if #drawn == 0 then return nil end
  local out, px, py = frame(x0, x1, y0, y1)
  for _, e in ipairs(drawn) do
    local attrs = ("data-run=\"%s\" data-tag=\"%s\" fill=\"%s\""):format(esc(e.run), esc(tag), e.color)
    local st, sv = e.s.steps, e.s.values
    out[#out + 1] = ("<path class=\"range\" %s d=\"%s\"/>"):format(attrs, band_d(st, sv,
      function(h) return h.min end, function(h) return h.max end, px, py))
    out[#out + 1] = ("<path class=\"sigma\" %s d=\"%s\"/>"):format(attrs, band_d(st, sv,
      function(h) return h.mean - h.std end, function(h) return h.mean + h.std end, px, py))
    local means = {}
    for i, h in ipairs(sv) do means[i] = h.mean end
    out[#out + 1] = ("<path class=\"smoothed\" data-run=\"%s\" data-tag=\"%s\" stroke=\"%s\" d=\"%s\"/>"):format(
      esc(e.run), esc(tag), e.color, path_d(st, means, px, py))
  end
  out[#out + 1] = "</svg>"
  return ("<section><h2>%s <small>(histogram: min-max, mean &plusmn; std)</small></h2>%s%s</section>"):format(
    esc(tag), table.concat(out), legend(drawn))
end

local function text_table(tag, runs)
  local rows = {}
  for _, run in ipairs(runs) do
    local s = run.texts[tag]
    for i = 1, s and #s.steps or 0 do
      rows[#rows + 1] = ("<tr><td>%s</td><td>%s</td><td><pre>%s</pre></td></tr>"):format(esc(run.name),
        num(s.steps[i]), esc(s.values[i]))
    end
  end
  if #rows == 0 then return nil end
  return ("<section><h2>%s <small>(text)</small></h2><table><tr><th>run</th><th>step</th><th>text</th></tr>%s" ..
    "</table></section>"):format(esc(tag), table.concat(rows))
end

local function tags_of(runs, field)
  local seen, list = {}, {}
  for _, run in ipairs(runs) do
    for tag in pairs(run[field]) do
      if not seen[tag] then seen[tag] = true; list[#list + 1] = tag end
    end
  end
  table.sort(list)
  return list
end

local STYLE = [[
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#202124}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:24px 0 6px} small{color:#5f6368;font-weight:normal}
.meta{color:#5f6368;margin-bottom:8px} .warn{color:#b3261e}
svg{display:block;max-width:100%;height:auto}
.grid{stroke:#e8eaed;stroke-width:1} .axes{fill:none;stroke:#9aa0a6;stroke-width:1}
.tick{font-size:11px;fill:#5f6368}
path.raw{fill:none;stroke-width:1;stroke-opacity:.25} path.smoothed{fill:none;stroke-width:1.6}
path.range{stroke:none;fill-opacity:.12} path.sigma{stroke:none;fill-opacity:.28}
.legend span{margin-right:14px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
table{border-collapse:collapse} td,th{border:1px solid #dadce0;padding:2px 8px;text-align:left;vertical-align:top}
pre{margin:0;white-space:pre-wrap}
]]

-- the page for runs (loaded); o: title, smoothing, logdir
function M.render(runs, o)
  local colors = {}
  for i, run in ipairs(runs) do colors[run.name] = COLORS[(i - 1) % #COLORS + 1] end
  local body = {}
  for _, tag in ipairs(tags_of(runs, "scalars")) do body[#body + 1] = scalar_chart(tag, runs, colors, o.smoothing) end
  for _, tag in ipairs(tags_of(runs, "hists")) do body[#body + 1] = histogram_chart(tag, runs, colors) end
  for _, tag in ipairs(tags_of(runs, "texts")) do body[#body + 1] = text_table(tag, runs) end
  if #body == 0 then body[1] = "<p>No scalars, histograms or text in these event files yet.</p>" end
  local warnings = {}
  for _, run in ipairs(runs) do
    for _, w in ipairs(run.warnings) do warnings[#warnings + 1] = "<div class=\"warn\">" .. esc(w) .. "</div>" end
  end
  local names = {}
  for _, run in ipairs(runs) do names[#names + 1] = run.name end
  return table.concat({
    "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>", esc(o.title), "</title><style>", STYLE,
    "</style></head><body><h1>", esc(o.title), "</h1><div class=\"meta\">", #runs, " run", #runs == 1 and "" or "s",
    " (", esc(table.concat(names, ", ")), ") from ", esc(o.logdir), "; smoothing ", num(o.smoothing),
    " (TensorBoard's, debiased); drawn ", os.date("%Y-%m-%d %H:%M:%S"), "</div>", table.concat(warnings),
    table.concat(body, "\n"), "\n</body></html>\n"})
end

local function usage_error(msg)
  io.stderr:write("rpchost plot: ", msg, "\n", M.USAGE)
  return 2
end

function M.main(argv)
  local o = {out = "plot.html", smoothing = 0.6}
  local i = 1
  while argv[i] do
    local a, v = argv[i], argv[i + 1]
    if a == "-h" or a == "--help" then io.stdout:write(M.USAGE); return 0 end
    local takes = a == "-o" or a == "--output" or a == "--smoothing" or a == "--title"
    if takes and v == nil then return usage_error(a .. " needs a value") end
    if a == "-o" or a == "--output" then o.out = v
    elseif a == "--title" then o.title = v
    elseif a == "--smoothing" then
      o.smoothing = tonumber(v)
      if not o.smoothing or o.smoothing < 0 or o.smoothing >= 1 then
        return usage_error("--smoothing takes a weight from 0 to 0.999, got " .. v)
      end
    elseif a:sub(1, 1) == "-" then return usage_error("unknown option " .. a)
    elseif o.logdir then return usage_error("one LOGDIR only (got " .. o.logdir .. " and " .. a .. ")")
    else o.logdir = a end
    i = i + (takes and 2 or 1)
  end
  if not o.logdir then return usage_error("which LOGDIR? (the log_dir, or a directory above several)") end
  o.title = o.title or o.logdir
  local runs = M.runs(o.logdir)
  if #runs == 0 then
    io.stderr:write(("rpchost plot: no event files (events.out.tfevents.*) under %s\n"):format(o.logdir))
    return 1
  end
  local ok, err = pcall(function()
    for _, run in ipairs(runs) do M.load(run) end
  end)
  if not ok then io.stderr:write(tostring(err), "\n"); return 1 end
  local html = M.render(runs, o)
  if o.out == "-" then io.stdout:write(html); return 0 end
  local f, ferr = io.open(o.out, "wb")
  local written = f and f:write(html)
  local closed = f and f:close()
  if not (written and closed) then
    io.stderr:write(("rpchost plot: cannot write %s: %s\n"):format(o.out, tostring(ferr or "write failed")))
    return 1
  end
  local ntags = #tags_of(runs, "scalars") + #tags_of(runs, "hists") + #tags_of(runs, "texts")
  io.stdout:write(("rpchost plot: wrote %s (%d tag%s, %d run%s)\n"):format(o.out, ntags, ntags == 1 and "" or "s",
    #runs, #runs == 1 and "" or "s"))
  for _, run in ipairs(runs) do
    for _, w in ipairs(run.warnings) do io.stderr:write("rpchost plot: warning: ", w, "\n") end
  end
  return 0
end

return M
