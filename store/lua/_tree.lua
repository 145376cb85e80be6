-- Prepended to the scripts that count a model call's spend or check a tree's budget (see store/scripts.py).
-- A run's keys and its ancestors' keys have different hash tags ({run:<id>} each): a script that touches
-- both works on one Redis server, not on Redis Cluster. The pool's sharding keeps a child run on its
-- parent's server (a child is created there, by its parent's turn), so these scripts never span servers.
--   roll_up_spend(run, headers, first) -> adds ARGV[first .. first+3] (input, output, cache-read,
--       cache-write tokens) and ARGV[first+4] (USD) to the tree counters (tree_*) of each ancestor
--       header in `headers`, in the script that counts the call on the run itself: a tree's usage is
--       live and counted once. A run made before ancestors were recorded (no `ancestors` field) rolls
--       up when it ends instead (_join.lua); an ancestor whose record expired is skipped.
--   tree_exhausted(header) -> 'tokens' or 'usd' when the run's usage with its sub-agents' (own and
--       tree counters) has reached its budget for the tree (cap_tokens, cap_usd: its own limits,
--       written when it starts a child run), else nil
--   keys_from(i), ancestor_headers(at, join_keys) -> tables of KEYS: KEYS[i..]; KEYS[at] then
--       KEYS[at + join_keys ..] (the parent's header followed by the keys beyond its join keys)
local function roll_up_spend(run, headers, first)
  if #headers == 0 or redis.call('HEXISTS', run, 'ancestors') == 0 then return end
  -- made here, not at the helper's top (see store/scripts.py)
  local tree_usage = {'tree_input_tokens', 'tree_output_tokens', 'tree_cache_read_input_tokens',
    'tree_cache_creation_input_tokens'}
  for _, header in ipairs(headers) do
    if redis.call('EXISTS', header) == 1 then
      for i, name in ipairs(tree_usage) do
        if tonumber(ARGV[first + i - 1]) ~= 0 then redis.call('HINCRBY', header, name, ARGV[first + i - 1]) end
      end
      if tonumber(ARGV[first + 4]) ~= 0 then redis.call('HINCRBYFLOAT', header, 'tree_cost_usd', ARGV[first + 4]) end
    end
  end
end
local function tree_exhausted(header)
  local h = redis.call('HMGET', header, 'cap_tokens', 'cap_usd', 'input_tokens', 'output_tokens',
    'cache_read_input_tokens', 'cache_creation_input_tokens', 'tree_input_tokens', 'tree_output_tokens',
    'tree_cache_read_input_tokens', 'tree_cache_creation_input_tokens', 'cost_usd', 'tree_cost_usd')
  local tokens = 0
  for i = 3, 10 do tokens = tokens + (tonumber(h[i]) or 0) end
  if h[1] and h[1] ~= '' and tokens >= tonumber(h[1]) then return 'tokens' end
  local cost = (tonumber(h[11]) or 0) + (tonumber(h[12]) or 0)
  if h[2] and h[2] ~= '' and cost >= tonumber(h[2]) then return 'usd' end
  return nil
end
local function keys_from(i)
  local out = {}
  for k = i, #KEYS do out[#out + 1] = KEYS[k] end
  return out
end
local function ancestor_headers(at, join_keys)
  local out = {KEYS[at]}
  for k = at + join_keys, #KEYS do out[#out + 1] = KEYS[k] end
  return out
end
