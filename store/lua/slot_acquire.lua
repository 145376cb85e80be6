-- Take a slot of a concurrency key for a run's turn, or a place in the line for one (fair shares:
-- at most `limit` turns of the key in flight across the pool). The limit an operator set for the key
-- wins over the run's own. A slot ("<run id>|<lease token>") is held while that turn holds its lease:
-- a holder whose lease is gone or has moved on (its turn ended, its worker died) frees its slot here. A run that waits goes in line by when it
-- began to wait; a slot is granted only if no live waiter ahead of it would be left without one.
-- KEYS[1] slots zset  KEYS[2] waiting zset  KEYS[3] wake hash  KEYS[4] operator limits hash
-- KEYS[5] set of known keys  KEYS[6..] the lease key of each holder in ARGV[6..] (read just before)
-- ARGV[1] concurrency key  ARGV[2] run id  ARGV[3] the run's max_concurrency (0: none)
-- ARGV[4] how long a waiter's place lasts without its wake record (ms)  ARGV[5] this turn's lease token
-- ARGV[6..] the holders ("<run id>|<token>")
-- Returns {1, held, ahead} granted (or already held), {0, held, ahead} wait, {2, 0, 0} no limit; ahead
-- counts the live waiters read ahead of this run and those not read.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or ARGV[3])
redis.call('SADD', KEYS[5], ARGV[1])
if not limit or limit < 1 then return {2, 0, 0} end
local mine = ARGV[2] .. '|' .. ARGV[5]
if redis.call('ZSCORE', KEYS[1], mine) then return {1, redis.call('ZCARD', KEYS[1]), 0} end
for i = 6, #ARGV do
  local token = string.match(ARGV[i], '|(.*)$')
  if redis.call('GET', KEYS[i]) ~= token then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
local held = redis.call('ZCARD', KEYS[1])
-- The waiters ahead of this run, read from the head of the line only until they alone take the slots
-- left: this run then waits whatever the rest are, and those not read count as ahead of it (a long
-- line costs a turn a few reads, not one per waiter). Expired waiters leave the line as they are read.
local rank = redis.call('ZRANK', KEYS[2], ARGV[2])
local upto = rank or redis.call('ZCARD', KEYS[2])
local ahead = 0
local read = walk_line(KEYS[2], upto, function(m, since)
  local wake = redis.call('HGET', KEYS[3], m)
  local expires = wake and tonumber(string.match(wake, '^(%d+)|')) or (since + tonumber(ARGV[4]))
  if expires < now then
    redis.call('ZREM', KEYS[2], m)
    redis.call('HDEL', KEYS[3], m)
    return true
  end
  ahead = ahead + 1
end, function() return held + ahead < limit end)
ahead = ahead + upto - read
if held + ahead < limit then
  redis.call('ZADD', KEYS[1], now, mine)
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
  return {1, held + 1, ahead}
end
redis.call('ZADD', KEYS[2], 'NX', now, ARGV[2])
return {0, held, ahead}
