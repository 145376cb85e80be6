-- Fenced: a run stops before its model call because the budget for the tree of one of its ancestors
-- (the holder: its max_total_tokens or max_cost_usd caps the run and all its sub-agents) is used up.
-- It is held, not ended: its parent's join stays open (no error result to the parent), and it goes on
-- when the holder is resumed (agentpool.runtime.tree). The holder's usage is checked again here
-- (tree_exhausted), so a holder resumed meanwhile holds nothing: 0, nothing changed, go on. A holder
-- that waits for its children stops with it, resumably, and tells its own parent (_join.lua: to its
-- parent, the holder stopped on its own limit); a holder still running stops at its next model call,
-- or instead of waiting (wait_children.lua).
-- KEYS[1] run header  KEYS[2] lease  KEYS[3] ap:runs:watch  KEYS[4] ap:stats  KEYS[5] events
-- KEYS[6] hand-back record  KEYS[7] the holder's header  KEYS[8] the holder's events
-- KEYS[9..11] the holder's parent's header, joins hash and events (when the holder has a parent)
-- ARGV[1] token  ARGV[2] now ms  ARGV[3] run id  ARGV[4] reason  ARGV[5] holder id  ARGV[6] the holder's
-- reason  ARGV[7] write id  ARGV[8..] two events (see _event.lua): this run's stop, then the holder's
-- Last, the holder's deliveries hash, then the webhook's keys and argument for this run (see _webhook.lua:
-- taken off first): each run that stops here records its webhook delivery.
-- Safe to deliver twice: a re-delivery of the same write id returns the first result.
-- Returns 1 held, 2 held and the holder stopped (3: and that woke the holder's parent), 0 the holder's
-- budget is not used up (nothing changed), -1 lease lost, -2 not running.
local webhook = take_webhook()
local holder_webhook = {deliveries = table.remove(KEYS), due = webhook.due, pool = webhook.pool}
local seen = replayed(KEYS[1], ARGV[7])
if seen then return tonumber(seen) end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return -2 end
if not tree_exhausted(KEYS[7]) then return 0 end
redis.call('HSET', KEYS[1], 'status', 'stopped', 'error', ARGV[4], 'held', ARGV[5], 'updated_at', ARGV[2])
record_webhook(webhook, KEYS[1], ARGV[3], 'stopped', ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('DEL', KEYS[6])
redis.call('ZREM', KEYS[3], ARGV[3])
local at = record_event(KEYS[5], KEYS[4], 8)
local code = 1
if redis.call('HGET', KEYS[7], 'status') == 'waiting_children' then
  redis.call('HSET', KEYS[7], 'status', 'stopped', 'error', ARGV[6], 'updated_at', ARGV[2])
  record_webhook(holder_webhook, KEYS[7], ARGV[5], 'stopped', ARGV[2])
  redis.call('ZREM', KEYS[3], ARGV[5])
  record_event(KEYS[8], KEYS[4], at)
  code = 2
  if #KEYS >= 11 and join_parent(KEYS[7], 9, KEYS[3], ARGV[5], redis.call('HGET', KEYS[7], 'parent'), ARGV[2]) == 2 then
    code = 3
  end
end
remember(KEYS[1], ARGV[7], code)
return code
