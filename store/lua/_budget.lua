-- Prepended to the scripts that read a model's rate-limit budget hash (limit_settle, and through
-- _reserve.lua limit_reserve and lease_acquire: see store/scripts.py).
-- budget_fields() -> the budget's field names by dimension (1 requests, 2 input, 3 output): learned,
-- level, started. Spelled out, since a name joined at each use would be a new string for Lua to hash
-- every time; made by a call, not at the helper's top (see store/scripts.py).
local function budget_fields()
  return {'learned:requests', 'learned:input', 'learned:output'}, {'level:requests', 'level:input', 'level:output'},
    {'started:requests', 'started:input', 'started:output'}
end
-- read_budget(key, held) -> the fields the scripts read of a budget, in one HMGET, without a loop that
-- builds a table of the whole hash (about the same cost in Redis's instructions, measured with callgrind):
--   b:       b.at, b.line, b.headerless, b.started_at ('started:at'), b.swept, b.hashtable, b.pause,
--            b.line_sum ('line:sum': what the tickets in line need together, "requests input output")
--   learned, level, started: by dimension, the fields above
--   entries: the held entries of the reservation ids in the list `held`, in its order
-- Each value as stored (a string), nil when the field is not there.
-- (A turn's reservation or settle asks for one id: its HMGET is spelled out, a list built only for more.)
local function read_budget(key, held)
  local v
  if #held <= 1 then
    v = redis.call('HMGET', key, 'at', 'line', 'headerless', 'started:at', 'swept', 'learned:requests',
      'learned:input', 'learned:output', 'level:requests', 'level:input', 'level:output', 'started:requests',
      'started:input', 'started:output', 'hashtable', 'pause', 'line:sum', 'held:' .. (held[1] or ''))
  else
    local names = {'at', 'line', 'headerless', 'started:at', 'swept', 'learned:requests', 'learned:input',
      'learned:output', 'level:requests', 'level:input', 'level:output', 'started:requests', 'started:input',
      'started:output', 'hashtable', 'pause', 'line:sum'}
    for _, rid in ipairs(held) do table.insert(names, 'held:' .. rid) end
    v = redis.call('HMGET', key, unpack(names))
  end
  local entries = {}
  for j = 1, #held do entries[j] = v[17 + j] end
  return {at = v[1], line = v[2], headerless = v[3], started_at = v[4], swept = v[5], hashtable = v[15],
      pause = v[16], line_sum = v[17]},
    {v[6], v[7], v[8]}, {v[9], v[10], v[11]}, {v[12], v[13], v[14]}, entries
end
-- as_hashtable(b, fields): `fields` (to be written to the budget read as `b`) with the budget's
-- 'hashtable' field when it has none yet (or the shorter one an earlier version wrote). Its value is
-- longer than hash-max-listpack-value (64 bytes by default; 256 covers a server tuned up to four times
-- that, and costs each reservation's read 0.2 µs more than 85 did, where 1,024 cost 1.2), so Redis
-- converts the budget to a hash table and keeps it so. As a listpack (up to 128 or
-- 512 fields, by the server's setting), every field a command names is found by scanning the whole
-- hash, calls in flight included: with 300 calls in flight, the reservation's read took 23 µs instead
-- of 0.8 (measured, Redis 7.0). Written once; each reservation reads it back with the budget's HMGET.
local HASHTABLE = 'kept a hash table: calls in flight are fields here, and a listpack is scanned whole'
local HASHTABLE_BYTES = 256
local function as_hashtable(b, fields)
  if not b.hashtable or #b.hashtable < HASHTABLE_BYTES then
    table.insert(fields, 'hashtable')
    table.insert(fields, HASHTABLE .. string.rep('.', HASHTABLE_BYTES - #HASHTABLE))
  end
  return fields
end
-- held_entries(key) -> {reservation id, entry} of every call in flight (the budget's 'held:<id>' fields).
local function held_entries(key)
  local all, out = redis.call('HGETALL', key), {}
  for i = 1, #all, 2 do
    local rid = string.match(all[i], '^held:(.*)$')
    if rid then table.insert(out, {rid, all[i + 1]}) end
  end
  return out
end
-- limit_in_force(set, learned) -> the lower of the operator's limit and the API's, either one alone, 0 for none.
local function limit_in_force(set, learned)
  if set > 0 and learned > 0 then return math.min(set, learned) end
  if set > 0 then return set end
  return learned
end
-- refilled(stored, limit, at, now, minute) -> a bucket's level (`stored`, a string or nil for a full bucket)
-- refilled from `at` to `now` at `limit` a minute, never past the limit.
local function refilled(stored, limit, at, now, minute)
  return math.min(limit, (stored or limit) + math.max(0, now - at) * limit / minute)
end
