-- Prepended to the scripts that end a run (see store/scripts.py and store/children.py).
-- join_parent(child, at, now) is called by a child run's terminal write (completed, failed, stopped,
-- cancelled), inside the script that makes it, so that the parent hears of it exactly once whatever
-- dies afterwards. KEYS[at], KEYS[at + 1], KEYS[at + 2] are the parent's header, its joins hash and
-- its events stream; ARGV gives none of them when the run has no parent (the caller passes no keys).
-- It marks the child ended in the parent's joins hash (once: a later end of a resumed child changes
-- nothing), rolls the child's usage and cost (its own and its children's) into the parent's tree
-- counters, and when no child of the parent is open any more and the parent waits for them, sets the
-- parent running with a `wake` marker and makes it due in the reaper's watch set (KEYS[watch]): the
-- reaper, or the child's own worker at once, queues the parent's turn from that marker, exactly once.
-- Returns 2 if the parent was woken, 1 if only marked, 0 if nothing was to be done.
local USAGE = {'input_tokens', 'output_tokens', 'cache_read_input_tokens', 'cache_creation_input_tokens'}
local function join_parent(child, at, watch, child_id, parent_id, now)
  local parent, joins, events = KEYS[at], KEYS[at + 1], KEYS[at + 2]
  if redis.call('HGET', joins, child_id) ~= 'open' then return 0 end
  redis.call('HSET', joins, child_id, 'ended')
  for _, name in ipairs(USAGE) do
    local h = redis.call('HMGET', child, name, 'tree_' .. name)
    local n = (tonumber(h[1]) or 0) + (tonumber(h[2]) or 0)
    if n ~= 0 then redis.call('HINCRBY', parent, 'tree_' .. name, n) end
  end
  local c = redis.call('HMGET', child, 'cost_usd', 'tree_cost_usd')
  local cost = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0)
  if cost ~= 0 then redis.call('HINCRBYFLOAT', parent, 'tree_cost_usd', cost) end
  for _, state in ipairs(redis.call('HVALS', joins)) do
    if state == 'open' then return 1 end
  end
  if redis.call('HGET', parent, 'status') ~= 'waiting_children' then return 1 end
  redis.call('HSET', parent, 'status', 'running', 'wake', '1', 'updated_at', now)
  redis.call('ZADD', watch, 0, parent_id)
  redis.call('XADD', events, 'MAXLEN', '~', 1000, '*', 'kind', 'children_joined', 'at', now, 'last', child_id)
  return 2
end
