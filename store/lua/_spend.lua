-- Prepended to the scripts that count a model call's spend (see store/scripts.py):
--   add_spend(header, first) -> adds ARGV[first .. first+3] (input, output, cache-read, cache-write
--                               tokens) and ARGV[first+4] (cost in USD) to the run's counters (a zero
--                               adds nothing, and costs no command)
local SPEND_FIELDS = {'input_tokens', 'output_tokens', 'cache_read_input_tokens', 'cache_creation_input_tokens'}
local function add_spend(header, first)
  for i, field in ipairs(SPEND_FIELDS) do
    if tonumber(ARGV[first + i - 1]) ~= 0 then redis.call('HINCRBY', header, field, ARGV[first + i - 1]) end
  end
  if tonumber(ARGV[first + 4]) ~= 0 then redis.call('HINCRBYFLOAT', header, 'cost_usd', ARGV[first + 4]) end
end
