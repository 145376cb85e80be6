-- Pause a model's calls pool-wide: a 429 came back with nothing the budget could learn from (no
-- rate-limit headers: a gateway's), so its retry-after is the only word on when to call again, and it
-- holds for every call of the model, not only the one that met it. Until then each reservation answers
-- a wait (_reserve.lua); a later pause only ever extends it. On Redis's clock, as the budget is.
-- KEYS[1] the model's budget hash   ARGV[1] the pause in ms
-- Returns when the pause ends, in Redis ms.
local t = redis.call('TIME')
local ends = t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[1])
local current = tonumber(redis.call('HGET', KEYS[1], 'pause') or '0') or 0
if ends > current then
  redis.call('HSET', KEYS[1], 'pause', ends)
  return ends
end
return current
