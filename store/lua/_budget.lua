-- Prepended to the scripts that read a model's rate-limit budget hash (limit_settle, and through
-- _reserve.lua limit_reserve and lease_acquire: see store/scripts.py).
-- The budget's fields by dimension (1 requests, 2 input, 3 output), spelled out: a name joined at each
-- call would be a new string for Lua to hash every time.
local LEARNED = {'learned:requests', 'learned:input', 'learned:output'}
local LEVEL = {'level:requests', 'level:input', 'level:output'}
local STARTED = {'started:requests', 'started:input', 'started:output'}
-- read_budget(key) -> the fields the scripts read of a budget, in one HMGET, without a loop that builds a
-- table of the hash (measured with callgrind: about what that costs for today's fourteen fields):
--   b:       b.at, b.line, b.headerless, b.started_at ('started:at'), b.swept
--   learned, level, started: by dimension, the fields above
-- Each value as stored (a string), nil when the field is not there.
local function read_budget(key)
  local v = redis.call('HMGET', key, 'at', 'line', 'headerless', 'started:at', 'swept', LEARNED[1], LEARNED[2],
    LEARNED[3], LEVEL[1], LEVEL[2], LEVEL[3], STARTED[1], STARTED[2], STARTED[3])
  return {at = v[1], line = v[2], headerless = v[3], started_at = v[4], swept = v[5]}, {v[6], v[7], v[8]},
    {v[9], v[10], v[11]}, {v[12], v[13], v[14]}
end
