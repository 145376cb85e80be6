-- Prepended to the scripts that keep a line of waiters (see store/scripts.py): the calls waiting for a
-- model's budget (_reserve.lua, limit_leave.lua) and the runs waiting for a concurrency key's slot
-- (slot_acquire.lua).
--   walk_line(line, upto, visit, more) -> reads the line's first `upto` members (the zset `line`, by
--       when each began to wait; expired ones included) from its head, 32 at a time, for as long as
--       more() holds: asked before each chunk and after each member kept. visit(member, score) returns
--       true when it took the member out of the line (expired), so the next chunk starts where this
--       one ended. Returns how many members were read.
--   numbers_of(text, n) -> the n space-separated numbers of a record (n = 3: a budget line's sum,
--       "<requests> <input tokens> <output tokens>"; n = 4: a ticket's need, those and when its place
--       expires, in ms), as a table; nil if the text is not one.
--   sum_text(t) -> {requests, input, output} written as a budget line's sum.
local function walk_line(line, upto, visit, more)
  local read, start = 0, 0
  while read < upto and more() do
    local chunk = redis.call('ZRANGE', line, start, start + math.min(upto - read, 32) - 1, 'WITHSCORES')
    if #chunk == 0 then break end
    local removed = 0
    for i = 1, #chunk, 2 do
      read = read + 1
      if visit(chunk[i], chunk[i + 1]) then
        removed = removed + 1
      elseif not more() then
        return read
      end
    end
    start = start + #chunk / 2 - removed
  end
  return read
end
local function numbers_of(text, n)
  local a, b, c, d = string.match(text or '', n == 3 and '^(%S+) (%S+) (%S+)$' or '^(%S+) (%S+) (%S+) (%S+)$')
  local out = {tonumber(a), tonumber(b), tonumber(c), tonumber(d)}
  if not (out[1] and out[2] and out[3] and (n == 3 or out[4])) then return nil end
  return out
end
local function sum_text(t)
  return string.format('%.0f %.0f %.0f', t[1], t[2], t[3])
end
