-- Extend a lease the caller still owns (the heartbeat).
-- KEYS[1] lease   KEYS[2] ap:runs:watch
-- ARGV[1] token  ARGV[2] ttl ms  ARGV[3] now ms  ARGV[4] run id
-- Returns 1 extended, 0 not the owner any more.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]) + tonumber(ARGV[2]), ARGV[4])
return 1
