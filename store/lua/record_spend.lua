-- Count what a model call cost, the moment its reply arrives (before save point A), so a call whose
-- turn is then lost to a crash still counts against the run's token and cost budgets.
-- Records the model_responded event with it.
-- KEYS[1] run header   KEYS[2] lease   KEYS[3] events   KEYS[4] ap:stats
-- ARGV[1] token  ARGV[2..5] input, output, cache-read, cache-write tokens  ARGV[6] cost in USD
-- ARGV[7..] the event (see _event.lua)
-- Returns 1 counted, -1 lease lost.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'cache_read_input_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'cache_creation_input_tokens', ARGV[5])
redis.call('HINCRBYFLOAT', KEYS[1], 'cost_usd', ARGV[6])
record_event(KEYS[3], KEYS[4], 7)
return 1
