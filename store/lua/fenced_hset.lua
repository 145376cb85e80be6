-- Fenced HSET into one of a run's hashes: a tool's intent (before it runs) or outcome (right after)
-- in the ledger, or a request for a person's decision in the approvals hash.
-- Refused once the writer lost the lease or the run left `running` (cancelled): a zombie or a
-- cancelled turn can neither start a tool nor record one.
-- Records the event that reports the write (tool_started, tool_finished...), if given.
-- Safe to deliver twice by nature: every record carries its writer's token and a timestamp, so a
-- field that already holds exactly this record was written by this very request, whose reply was
-- lost: it answers 1 again, recording no second event.
-- KEYS[1] lease   KEYS[2] run header   KEYS[3] the hash to write   KEYS[4] events   KEYS[5] ap:stats
-- ARGV[1] token  ARGV[2] field  ARGV[3] record blob  ARGV[4..] the event (see _event.lua)
-- Returns 1 written, -1 lease lost, -2 run not running.
if redis.call('HGET', KEYS[3], ARGV[2]) == ARGV[3] then return 1 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[2], 'status') ~= 'running' then return -2 end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
record_event(KEYS[4], KEYS[5], 4)
return 1
