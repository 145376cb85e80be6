-- Take a ticket out of the line of calls waiting for a model's budget (its turn will not call), and
-- its need out of the line's sum ('line:sum': what the tickets in line need together, which a newcomer
-- waits for). Safe to deliver twice: a ticket no longer in line changes nothing.
-- KEYS[1] the model's budget hash  KEYS[2] waiting zset  KEYS[3] needs hash   ARGV[1] the ticket
-- Returns 1 if the ticket was in line, 0 if not.
local rec = numbers_of(redis.call('HGET', KEYS[3], ARGV[1]), 4)
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
local sum = numbers_of(redis.call('HGET', KEYS[1], 'line:sum'), 3)
if rec and sum then
  redis.call('HSET', KEYS[1], 'line:sum', sum_text({math.max(0, sum[1] - rec[1]), math.max(0, sum[2] - rec[2]),
    math.max(0, sum[3] - rec[3])}))
end
return 1
