-- Settle a reservation once its call is over: what it did not use goes back to the buckets (or what
-- it used beyond the estimate is taken), and the limits and remaining budget the API's headers
-- reported are learned. Once per reservation id: a re-sent call finds it settled and changes nothing.
-- The headers come first, then the correction: the API's remaining was counted before this call's
-- own correction too (it holds max_tokens until the reply ends, as the reservation did).
-- KEYS[1] budget hash  KEYS[2] held hash  KEYS[3] set of models with a budget
-- ARGV[1] unused  ARGV[2] minute ms  ARGV[3] reservation id ('' for headers alone)
-- ARGV[4..5] input, output tokens to give back (negative: taken)
-- ARGV[6..8] operator limits rpm, itpm, otpm (0: none)
-- ARGV[9..11] learned limits requests, input, output (0: not reported)
-- ARGV[12..14] remaining requests, input, output as reported (-1: not reported)  ARGV[15] model
-- ARGV[16..18] for a call made while nothing limited the model: the requests and tokens started unlimited
-- as its reservation counted them (limit_reserve); -1 otherwise. The remaining its headers report was
-- counted when the API admitted it; the calls started unlimited after it were not counted yet, and no
-- bucket here took them either, so they come off the remaining (the first calls of a pool that has not
-- learned its limits yet would otherwise be followed by calls the API refuses).
-- Returns 1 settled, 0 nothing held under that id (headers still learned).
-- Redis's clock, not the caller's: every worker's refill is measured on one clock.
local t = redis.call('TIME')
local now, minute = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(ARGV[2])
local settled = 0
if ARGV[3] ~= '' and redis.call('HDEL', KEYS[2], ARGV[3]) == 1 then settled = 1 end
local dims = {'requests', 'input', 'output'}
local back = {0, tonumber(ARGV[4]), tonumber(ARGV[5])}
if settled == 0 then back = {0, 0, 0} end
local state = redis.call('HGETALL', KEYS[1])
local h = {}
for i = 1, #state, 2 do h[state[i]] = state[i + 1] end
local at = tonumber(h['at'] or now)
local fields = {'at', now}
for i, d in ipairs(dims) do
  local learned = tonumber(ARGV[8 + i])
  if learned > 0 then
    table.insert(fields, 'learned:' .. d); table.insert(fields, learned)
    redis.call('SADD', KEYS[3], ARGV[15])
  else
    learned = tonumber(h['learned:' .. d] or 0)
  end
  local set = tonumber(ARGV[5 + i])
  local l = 0
  if set > 0 and learned > 0 then l = math.min(set, learned) elseif set > 0 then l = set else l = learned end
  if l > 0 then
    local lv = tonumber(h['level:' .. d] or l)
    lv = math.min(l, lv + math.max(0, now - at) * l / minute)
    local remaining = tonumber(ARGV[11 + i])
    if remaining >= 0 then
      local started_at = tonumber(ARGV[15 + i])
      if started_at >= 0 then remaining = remaining - (tonumber(h['started:' .. d] or 0) - started_at) end
      lv = math.min(lv, remaining)
    end
    lv = math.min(l, lv + back[i])
    table.insert(fields, 'level:' .. d); table.insert(fields, lv)
  end
end
redis.call('HSET', KEYS[1], unpack(fields))
return settled
