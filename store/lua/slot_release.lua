-- A run's turn is over: free its slot of a concurrency key and wake the first live waiter (its
-- deferred turn is made due now, so the next reaper scan enqueues it). Nothing to free, nothing woken.
-- KEYS[1] slots zset  KEYS[2] waiting zset  KEYS[3] wake hash  KEYS[4] ap:turns:deferred
-- ARGV[1] the slot ("<run id>|<lease token>")
-- Returns 1 if a waiter was woken, 0 otherwise.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, 9)) do
  local wake = redis.call('HGET', KEYS[3], m)
  local member = wake and string.match(wake, '^%d+|(.+)$')
  if member and redis.call('ZSCORE', KEYS[4], member) then
    redis.call('ZADD', KEYS[4], 'XX', now, member)
    return 1
  end
end
return 0
