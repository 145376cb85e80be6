-- Fenced: the parent's turn waits for its child runs without holding anything, unless they have all
-- ended already (a child that ended before this script ran found the parent running and only marked
-- itself in the joins hash). Sets status waiting_children, drops the lease and any hand-back record,
-- and leaves the run in the reaper's watch set at ARGV[3] (the backstop that looks at its children).
-- When the run's budget for its tree is used up (tree_exhausted: its own spend and its sub-agents'),
-- it stops instead, resumably, keeping its turn's joins: its children are held at their next model call
-- (hold.lua) and go on with it when it is resumed. Checked here, in the step that would make it wait,
-- because a child held while this run was still settling found it running and could not stop it. A
-- run with a parent tells it (_join.lua: its budget is its own, so to its parent it stopped).
-- KEYS[1] run header  KEYS[2] lease  KEYS[3] joins hash  KEYS[4] ap:runs:watch  KEYS[5] ap:stats
-- KEYS[6] events  KEYS[7] hand-back record  KEYS[8..10] its parent's header, joins hash, events (a child)
-- ARGV[1] token  ARGV[2] now ms  ARGV[3] watch score  ARGV[4] run id  ARGV[5] why it stops when its
-- budget is used up  ARGV[6..] two events (see _event.lua): the one reporting the wait, then the one
-- reporting the stop
-- Last, the webhook's keys and argument (see _webhook.lua: taken off first): a run that stops here
-- records its webhook delivery.
-- Returns 1 waiting, 0 every child has ended (nothing changed: go on), 2 stopped (3: and that woke its
-- parent), -1 lease lost, -2 not running.
local webhook = take_webhook()
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return -2 end
local open = false
for _, state in ipairs(redis.call('HVALS', KEYS[3])) do
  if state == 'open' then open = true; break end
end
if not open then return 0 end
redis.call('DEL', KEYS[2])
redis.call('DEL', KEYS[7])
local spent = tree_exhausted(KEYS[1])
if not spent then
  redis.call('HSET', KEYS[1], 'status', 'waiting_children', 'updated_at', ARGV[2])
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[4])
  record_event(KEYS[6], KEYS[5], 6)
  return 1
end
redis.call('HSET', KEYS[1], 'status', 'stopped', 'error', ARGV[5], 'updated_at', ARGV[2])
record_webhook(webhook, KEYS[1], ARGV[4], 'stopped', ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[4])
-- Past the first event (cap, n field pairs, m counter pairs), to the second.
local at = 6
if tonumber(ARGV[at]) ~= 0 then
  local m_at = at + 2 + 2 * tonumber(ARGV[at + 1])
  at = m_at + 1 + 2 * tonumber(ARGV[m_at])
else
  at = at + 1
end
record_event(KEYS[6], KEYS[5], at)
if #KEYS >= 10 and join_parent(KEYS[1], 8, KEYS[4], ARGV[4], redis.call('HGET', KEYS[1], 'parent'), ARGV[2]) == 2 then
  return 3
end
return 2
