-- Fenced: the parent's turn waits for its child runs without holding anything, unless they have all
-- ended already (a child that ended before this script ran found the parent running and only marked
-- itself in the joins hash). Sets status waiting_children, drops the lease and any hand-back record,
-- and leaves the run in the reaper's watch set at ARGV[3] (the backstop that looks at its children).
-- KEYS[1] run header  KEYS[2] lease  KEYS[3] joins hash  KEYS[4] ap:runs:watch  KEYS[5] ap:stats
-- KEYS[6] events  KEYS[7] hand-back record
-- ARGV[1] token  ARGV[2] now ms  ARGV[3] watch score  ARGV[4] run id  ARGV[5..] the event (see _event.lua)
-- Returns 1 waiting, 0 every child has ended (nothing changed: go on), -1 lease lost, -2 not running.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return -2 end
local open = false
for _, state in ipairs(redis.call('HVALS', KEYS[3])) do
  if state == 'open' then open = true; break end
end
if not open then return 0 end
redis.call('HSET', KEYS[1], 'status', 'waiting_children', 'updated_at', ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('DEL', KEYS[7])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[4])
record_event(KEYS[6], KEYS[5], 5)
return 1
