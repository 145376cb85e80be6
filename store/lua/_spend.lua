-- Prepended to the scripts that count a model call's spend (see store/scripts.py):
--   add_spend(header, first) -> adds ARGV[first .. first+3] (input, output, cache-read, cache-write
--                               tokens) and ARGV[first+4] (cost in USD) to the run's counters
local function add_spend(header, first)
  redis.call('HINCRBY', header, 'input_tokens', ARGV[first])
  redis.call('HINCRBY', header, 'output_tokens', ARGV[first + 1])
  redis.call('HINCRBY', header, 'cache_read_input_tokens', ARGV[first + 2])
  redis.call('HINCRBY', header, 'cache_creation_input_tokens', ARGV[first + 3])
  redis.call('HINCRBYFLOAT', header, 'cost_usd', ARGV[first + 4])
end
