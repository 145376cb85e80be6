-- Take a ticket out of the line of calls waiting for a model's budget (its turn will not call), and
-- its need out of the line's sum ('line:sum': what the tickets in line need together, which a newcomer
-- waits for). Safe to deliver twice: a ticket no longer in line changes nothing.
-- KEYS[1] the model's budget hash  KEYS[2] waiting zset  KEYS[3] needs hash   ARGV[1] the ticket
-- Returns 1 if the ticket was in line, 0 if not.
local rec = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
local r, i, o = string.match(rec or '', '^(%S+) (%S+) (%S+) %S+$')
local sr, si, so = string.match(redis.call('HGET', KEYS[1], 'line:sum') or '', '^(%S+) (%S+) (%S+)$')
if r and sr then
  redis.call('HSET', KEYS[1], 'line:sum', string.format('%.0f %.0f %.0f', math.max(0, sr - r),
    math.max(0, si - i), math.max(0, so - o)))
end
return 1
