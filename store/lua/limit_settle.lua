-- Settle reservations once their calls are over: what a call did not use goes back to the buckets (or
-- what it used beyond the estimate is taken), and the limits and remaining budget the API's headers
-- reported are learned. Once per reservation id: a re-sent call finds it settled and gives back nothing.
-- One call settles one reservation (a turn's, in its save point A's round trip) or several (a worker's
-- settles of the last second, sent together: agentpool.store.ratelimit.DeferredSettles), in the order
-- given, with one read and one write of the budget.
-- Each settle's headers come first, then its correction: the API's remaining was counted before this
-- call's own correction too (it holds max_tokens until the reply ends, as the reservation did).
-- KEYS[1] budget hash (the calls in flight are its 'held:<reservation id>' fields)  KEYS[2] the held hash
-- of earlier versions (only swept)  KEYS[3] set of models with a budget
-- ARGV[1] minute ms  ARGV[2..4] operator limits rpm, itpm, otpm (0: none)  ARGV[5] model
-- ARGV[6] how old a reservation made within limits must be to be dropped as dead (ms)  ARGV[7] how often
-- the calls in flight are looked through for those (ms; the budget's 'swept' says when they last were)
-- ARGV[8..] the settles, 14 values each:
--   +0 requests to give back (1: the call was reserved but never made)  +1 reservation id ('' for
--   headers alone)  +2, +3 input, output tokens to give back (negative: taken)
--   +4..6 learned limits requests, input, output (0: not reported)
--   +7..9 remaining requests, input, output as reported (-1: not reported)
--   +10..12 for a call made while nothing limited the model: the requests and tokens started unlimited
--   as its reservation counted them (limit_reserve); -1 otherwise. The remaining its headers report was
--   counted when the API admitted it, and no bucket here took the calls started unlimited, so two kinds
--   come off that remaining (the first calls of a pool that has not learned its limits yet would
--   otherwise be followed by calls the API refuses):
--     the calls started after it: the API had not counted them yet;
--     the calls started before it and still in flight (their 'held:' entries): the API admits
--     calls in its own order, and may count them after this one. One it had counted already comes off
--     twice, which only holds back what the buckets refill; missed, it would be a 429.
--   +13 1 if the API answered the call, 0 if it refused or failed it (what its remaining holds differs)
-- An entry of a call started unlimited counts for a minute (ARGV[1]) after it started: its worker may
-- have died, and by then the API has admitted it if it ever will, and refilled as much. Older ones are
-- deleted here, and once the last call started unlimited ('started:at') is a minute old, the next
-- settle deletes whatever is left of them and that field.
-- Returns how many reservations it settled (their 'held:' entries removed); a settle of
-- nothing held (settled already, or headers alone) still teaches what its headers say.
-- Redis's clock, not the caller's: every worker's refill is measured on one clock.
local t = redis.call('TIME')
-- The arguments are numbers as the worker wrote them: arithmetic converts each once (tonumber, twice).
local now, minute = t[1] * 1000 + math.floor(t[2] / 1000), ARGV[1] + 0
local FIRST, EACH = 8, 14
local count = (#ARGV - FIRST + 1) / EACH
-- The reservations' entries are read with the budget: each still held gives back once, though it came
-- twice (a re-sent batch), and leaves.
local ids = {}
for k = 0, count - 1 do
  local rid = ARGV[FIRST + k * EACH + 1]
  if rid ~= '' then table.insert(ids, rid) end
end
local b, b_learned, b_level, b_started, entries = read_budget(KEYS[1], ids)
local LEARNED, LEVEL = budget_fields()
local held_now, gone = {}, {}
for j = 1, #ids do
  if entries[j] then
    held_now[ids[j]] = true
    table.insert(gone, 'held:' .. ids[j])
  end
end
-- What the calls started unlimited and still in flight started after (seq), and need: read once, for
-- the settles of calls started unlimited.
local unlimited_in_flight = {}
local any_started = false
for k = 0, count - 1 do
  if ARGV[FIRST + k * EACH + 10] + 0 >= 0 then any_started = true end
end
local sweep = b.started_at and now - b.started_at >= minute
if any_started or sweep then
  for _, held in ipairs(held_entries(KEYS[1])) do
    local in_, out, ms, req, seq = string.match(held[2], '^(%S+) (%S+) (%S+) (%S+) (%S+) %S+ %S+$')
    if not seq or held_now[held[1]] then
      -- a reservation made within limits (its budget was taken already), or one settled here
    elseif now - tonumber(ms) >= minute then
      table.insert(gone, 'held:' .. held[1])
    else
      table.insert(unlimited_in_flight, {tonumber(seq), tonumber(req), tonumber(in_), tonumber(out)})
    end
  end
  if sweep then table.insert(gone, 'started:at') end
end
local at = (b.at or now) + 0
local fields = {'at', now}
-- A reservation made within limits whose worker died never settles either: every ARGV[7] ms, the ones
-- older than ARGV[6] ms (far longer than a call stays in flight) leave. Their budget refilled long ago;
-- left there, they would count as calls in flight (`agentpool limits`) for ever. So do those in the
-- held hash (KEYS[2]) where earlier versions kept the calls in flight.
if now - (b.swept or 0) >= ARGV[7] + 0 then
  for _, held in ipairs(held_entries(KEYS[1])) do
    local ms = tonumber(string.match(held[2], '^%S+ %S+ (%S+)$'))
    if ms and now - ms >= tonumber(ARGV[6]) and not held_now[held[1]] then table.insert(gone, 'held:' .. held[1]) end
  end
  local legacy = redis.call('HGETALL', KEYS[2])
  for i = 1, #legacy, 2 do
    local ms = tonumber(string.match(legacy[i + 1], '^%S+ %S+ (%S+)'))
    if ms and now - ms >= tonumber(ARGV[6]) then redis.call('HDEL', KEYS[2], legacy[i]) end
  end
  table.insert(fields, 'swept'); table.insert(fields, now)
end
if #gone > 0 then redis.call('HDEL', KEYS[1], unpack(gone)) end
local learned, learned_new = {}, {}
for i = 1, 3 do learned[i] = (b_learned[i] or 0) + 0 end
local level = {}  -- by dimension: refilled to now once, then corrected by each settle in turn
local settled = 0
for k = 0, count - 1 do
  local o = FIRST + k * EACH
  local rid = ARGV[o + 1]
  local back = {0, 0, 0}
  if held_now[rid] then
    held_now[rid] = false
    settled = settled + 1
    back = {ARGV[o] + 0, ARGV[o + 2] + 0, ARGV[o + 3] + 0}
  end
  local started_at = {ARGV[o + 10] + 0, ARGV[o + 11] + 0, ARGV[o + 12] + 0}
  local answered = ARGV[o + 13] == '1'
  local before = {0, 0, 0}
  if started_at[1] >= 0 then
    for _, call in ipairs(unlimited_in_flight) do
      if call[1] < started_at[1] then
        before[1], before[2], before[3] = before[1] + call[2], before[2] + call[3], before[3] + call[4]
      end
    end
  end
  for i = 1, 3 do
    local reported = ARGV[o + 3 + i] + 0
    -- Written only when it changed: every reply reports the same limits again.
    if reported > 0 and reported ~= learned[i] then
      learned[i] = reported
      learned_new[i] = true
    end
    local l = limit_in_force(ARGV[1 + i] + 0, learned[i])
    if l > 0 then
      local lv = level[i] or refilled(b_level[i], l, at, now, minute)
      local remaining = ARGV[o + 6 + i] + 0
      local reported = remaining >= 0  -- (what comes off it below may take it under 0: still a bound)
      if reported and started_at[i] >= 0 then
        remaining = remaining - ((b_started[i] or 0) - started_at[i]) - before[i]
      end
      if reported and i == 3 and answered then
        -- A reply's output tokens: the API holds max_tokens in its remaining until the reply ends, as
        -- the reservation did, so what the call did not use goes back on top of it.
        lv = math.min(lv, remaining) + back[i]
      else
        -- Input tokens (counted by the API as the call was admitted: its remaining has them already),
        -- and every dimension of a refused call (a 429: the API counted none of it): the give-back
        -- never lifts the budget above what the API said was left.
        lv = lv + back[i]
        if reported then lv = math.min(lv, remaining) end
      end
      level[i] = math.min(l, lv)
    end
  end
end
-- The model is listed among those with a budget when a limit is learned that the budget did not hold
-- (the reply of every call reports them again; one SADD a call would be one command a turn for nothing).
local listed = false
for i = 1, 3 do
  if learned_new[i] then
    listed = true
    table.insert(fields, LEARNED[i]); table.insert(fields, learned[i])
  end
  if level[i] then table.insert(fields, LEVEL[i]); table.insert(fields, level[i]) end
end
redis.call('HSET', KEYS[1], unpack(as_hashtable(b, fields)))
if listed then redis.call('SADD', KEYS[3], ARGV[5]) end
return settled
