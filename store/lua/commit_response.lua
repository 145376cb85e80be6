-- Save point A: the model's response is committed before any tool runs. Counts the turn and its
-- usage, appends the assistant message, records its tool_use blocks as pending. With a final
-- status (the model asked for no tool), ends the run in the same step and drops the lease.
-- KEYS[1] run header   KEYS[2] lease   KEYS[3] messages   KEYS[4] ap:runs:watch
-- ARGV[1] token  ARGV[2] turns before this call  ARGV[3] assistant message blob  ARGV[4] pending blob
-- ARGV[5..8] input, output, cache-read, cache-write tokens  ARGV[9] now ms  ARGV[10] run id
-- ARGV[11] final status or ''  ARGV[12] result text  ARGV[13] error text
-- Returns 1 ok, -1 lease lost, -2 run not running (status changed under us), -3 stale turn.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local h = redis.call('HMGET', KEYS[1], 'status', 'turns', 'phase')
if h[1] ~= 'running' then return -2 end
if h[2] ~= ARGV[2] or h[3] ~= 'model' then return -3 end
redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'cache_read_input_tokens', ARGV[7])
redis.call('HINCRBY', KEYS[1], 'cache_creation_input_tokens', ARGV[8])
redis.call('HSET', KEYS[1], 'phase', 'tools', 'pending', ARGV[4], 'model_errors', 0, 'updated_at', ARGV[9])
if ARGV[11] ~= '' then
  redis.call('HSET', KEYS[1], 'status', ARGV[11], 'phase', 'done', 'result', ARGV[12], 'error', ARGV[13])
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[4], ARGV[10])
end
return 1
