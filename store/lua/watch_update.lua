-- A change to the reaper's watch set (ap:runs:watch), made only if the run is still in the state the
-- change was decided from: a reaper that read "stopped" must not drop a run a person resumed since,
-- nor one whose approval was decided since it read the approvals (their count changed).
-- KEYS[1] run header   KEYS[2] ap:runs:watch   KEYS[3] approvals
-- ARGV[1] run id  ARGV[2] 'add' (ARGV[3] is the score) or 'rem'
-- ARGV[4] the condition: 'active' (status queued or running), 'inactive' (no header, or a status that
-- is never watched: stopped, completed, failed, cancelled), or 'approvals:<n>' (status
-- waiting_approval with exactly n approval records, as read), or 'children' (status waiting_children)
-- Returns 1 changed, 0 the state moved on (nothing done).
local status = redis.call('HGET', KEYS[1], 'status')
local ok
if ARGV[4] == 'active' then
  ok = status == 'queued' or status == 'running'
elseif ARGV[4] == 'inactive' then
  ok = not status or not (status == 'queued' or status == 'running' or status == 'waiting_approval'
    or status == 'waiting_children')
elseif ARGV[4] == 'children' then
  ok = status == 'waiting_children'
else
  local n = tonumber(string.match(ARGV[4], '^approvals:(%d+)$'))
  ok = status == 'waiting_approval' and n ~= nil and redis.call('HLEN', KEYS[3]) == n
end
if not ok then return 0 end
if ARGV[2] == 'add' then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
else
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return 1
