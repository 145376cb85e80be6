-- Prepended to the scripts that end a run (see store/scripts.py and store/children.py).
-- join_parent(child, at, watch, child_id, parent_id, now[, late_id, late_blob, ended_as]) is called by a child
-- run's terminal write (completed, failed, stopped, cancelled), inside the script that makes it, so that
-- the parent hears of it exactly once whatever dies afterwards. KEYS[at], KEYS[at + 1], KEYS[at + 2] are
-- the parent's header, its joins hash and its events stream (and, read only with a late answer,
-- KEYS[at + 3], KEYS[at + 4] its inbox and received hash); ARGV gives none of them when the run has no
-- parent (the caller passes no keys).
-- It marks the child ended in the parent's joins hash (once), with how it ended ("<child>:end": its
-- status then, `ended_as` when the caller has not written it yet: the parent's tool_result is that end,
-- whatever the child does later), and when no child of the parent is open
-- any more and the parent waits for them, sets the parent running with a `wake` marker and makes it due
-- in the reaper's watch set (KEYS[watch]): the reaper, or the child's own worker at once, queues the
-- parent's turn from that marker, exactly once. A child stopped because its tree's budget ran out is not
-- ended (hold.lua leaves it open): the parent waits for it to be resumed.
-- Usage is not added here: each call's spend reached the parent's tree counters when it was counted
-- (_tree.lua), except for a child made before that (no `ancestors` field), whose usage and cost (its
-- own and its children's) are rolled into the parent's tree counters now.
-- A child that ends again after its join had ended without an answer (it stopped, answered its parent
-- with an error, was resumed, and has now completed) gives its parent its answer late: `late_blob` (the
-- message content, packed by the caller) goes to the parent's inbox under `late_id` ("<child>:late" in
-- the joins hash records it), once per child, unless the parent has ended (completed, failed,
-- cancelled): the answer then stays readable from the child. A completion after that, or after a join
-- that ended completed, answers a message sent to the child: it stays with the child.
-- Returns 2 if the parent was woken, 1 if only marked, 3 if a late answer was queued, 0 if nothing was done.
local function join_parent(child, at, watch, child_id, parent_id, now, late_id, late_blob, ended_as)
  local parent, joins, events = KEYS[at], KEYS[at + 1], KEYS[at + 2]
  local joined = redis.call('HGET', joins, child_id)
  if joined ~= 'open' then
    if not joined or not late_blob or late_blob == '' then return 0 end
    -- Only the answer the parent never had: not when the join ended with one (the child completed, and
    -- completes again answering a message sent to it: that answer is the sender's, not the parent's),
    -- and only once (later completions are answers to messages too).
    if redis.call('HGET', joins, child_id .. ':end') == 'completed' then return 0 end
    if redis.call('HEXISTS', joins, child_id .. ':late') == 1 then return 0 end
    local status = redis.call('HGET', parent, 'status')
    if not status or status == 'completed' or status == 'failed' or status == 'cancelled' then return 0 end
    local inbox, received = KEYS[at + 3], KEYS[at + 4]
    if redis.call('HEXISTS', received, late_id) == 1 then return 0 end
    redis.call('HSET', received, late_id, late_blob)
    redis.call('HSET', joins, child_id .. ':late', late_id)
    redis.call('RPUSH', inbox, late_id)
    redis.call('XADD', events, 'MAXLEN', '~', 1000, '*', 'kind', 'message_queued', 'message', late_id,
      'status', status, 'child', child_id)
    return 3
  end
  -- A child whose record is gone (expired, evicted) ended as 'expired': its parent is told it no longer exists.
  local status = ended_as or redis.call('HGET', child, 'status') or 'expired'
  redis.call('HSET', joins, child_id, 'ended', child_id .. ':end', status)
  if redis.call('HEXISTS', child, 'ancestors') == 0 then
    -- (a table made here, not at the helper's top: see store/scripts.py)
    for _, name in ipairs({'input_tokens', 'output_tokens', 'cache_read_input_tokens', 'cache_creation_input_tokens'}) do
      local h = redis.call('HMGET', child, name, 'tree_' .. name)
      local n = (tonumber(h[1]) or 0) + (tonumber(h[2]) or 0)
      if n ~= 0 then redis.call('HINCRBY', parent, 'tree_' .. name, n) end
    end
    local c = redis.call('HMGET', child, 'cost_usd', 'tree_cost_usd')
    local cost = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0)
    if cost ~= 0 then redis.call('HINCRBYFLOAT', parent, 'tree_cost_usd', cost) end
  end
  for _, state in ipairs(redis.call('HVALS', joins)) do
    if state == 'open' then return 1 end
  end
  if redis.call('HGET', parent, 'status') ~= 'waiting_children' then return 1 end
  redis.call('HSET', parent, 'status', 'running', 'wake', '1', 'updated_at', now)
  redis.call('ZADD', watch, 0, parent_id)
  redis.call('XADD', events, 'MAXLEN', '~', 1000, '*', 'kind', 'children_joined', 'at', now, 'last', child_id)
  return 2
end
