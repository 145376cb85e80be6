-- Fenced HSET into one of a run's hashes: a tool's intent (before it runs) or outcome (right after)
-- in the ledger, or a request for a person's decision in the approvals hash.
-- Refused once the writer lost the lease or the run left `running` (cancelled): a zombie or a
-- cancelled turn can neither start a tool nor record one. Refused too when the run is not at the turn
-- and phase the writer believes (ARGV[4], ARGV[5]): a promoted replica can hold the lease but not the
-- save point A written after it, and an outcome recorded there would answer a tool_use the
-- conversation does not have.
-- Records the event that reports the write (tool_started, tool_finished...), if given.
-- Safe to deliver twice by nature: every record carries its writer's token and a timestamp, so a
-- field that already holds exactly this record was written by this very request, whose reply was
-- lost: it answers 1 again, recording no second event.
-- KEYS[1] lease   KEYS[2] run header   KEYS[3] the hash to write   KEYS[4] events   KEYS[5] ap:stats
-- ARGV[1] token  ARGV[2] field  ARGV[3] record blob  ARGV[4] the run's turns as the writer believes them
-- ('' checks neither)  ARGV[5] its phase  ARGV[6..] the event (see _event.lua)
-- Returns 1 written, -1 lease lost, -2 run not running, -3 the run is at another turn or phase.
if redis.call('HGET', KEYS[3], ARGV[2]) == ARGV[3] then return 1 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local h = redis.call('HMGET', KEYS[2], 'status', 'turns', 'phase')
if h[1] ~= 'running' then return -2 end
if ARGV[4] ~= '' and (h[2] ~= ARGV[4] or h[3] ~= ARGV[5]) then return -3 end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
record_event(KEYS[4], KEYS[5], 6)
return 1
