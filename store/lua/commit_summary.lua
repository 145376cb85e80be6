-- Fallback compaction's save: the summary of the window, written by the model in a call of its own,
-- becomes the message the next request starts from. Counts that call's tokens and cost first with the
-- compacted event (the call was made and billed), then appends the summary and moves the header's
-- window to it, in one step: a crash leaves the old window or the new one, never a mix.
-- Safe to deliver twice (a client retry after a lost reply): a summary already at its index is a no-op.
-- KEYS[1] run header   KEYS[2] lease   KEYS[3] messages   KEYS[4] ap:stats   KEYS[5] events
-- ARGV[1] token  ARGV[2] turns before this turn's model call  ARGV[3] the index the summary takes
-- ARGV[4] summary message blob  ARGV[5] now ms  ARGV[6..9] input, output, cache-read, cache-write tokens
-- ARGV[10] cost in USD  ARGV[11..] the compacted event (see _event.lua)
-- Returns 1 saved (or already saved), -1 lease lost (nothing counted), -2 run not running, -3 stale.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local length = redis.call('LLEN', KEYS[3])
if tostring(length) == tostring(tonumber(ARGV[3]) + 1) and redis.call('HGET', KEYS[1], 'window') == ARGV[3] then
  return 1
end
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[7])
redis.call('HINCRBY', KEYS[1], 'cache_read_input_tokens', ARGV[8])
redis.call('HINCRBY', KEYS[1], 'cache_creation_input_tokens', ARGV[9])
redis.call('HINCRBYFLOAT', KEYS[1], 'cost_usd', ARGV[10])
record_event(KEYS[5], KEYS[4], 11)
local h = redis.call('HMGET', KEYS[1], 'status', 'turns', 'phase')
if h[1] ~= 'running' then return -2 end
if h[2] ~= ARGV[2] or h[3] ~= 'model' or tostring(length) ~= ARGV[3] then return -3 end
redis.call('RPUSH', KEYS[3], ARGV[4])
redis.call('HSET', KEYS[1], 'window', ARGV[3], 'updated_at', ARGV[5])
return 1
