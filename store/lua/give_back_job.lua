-- Put a job a worker dequeued but will not run (a stop came first) back at the head of its queue.
-- Conditional on taking it out of RQ's intermediate queue, or out of the started registry when the
-- worker had claimed it (agentpool.worker.lean), so that a call delivered twice (its reply lost, the
-- client re-sending) pushes it once.
-- KEYS[1] RQ's intermediate queue (rq:queue:<name>:intermediate)   KEYS[2] the queue (rq:queue:<name>)
-- KEYS[3] the queue's started registry (rq:wip:<name>)
-- ARGV[1] job id   ARGV[2] the claim's member in that registry ('' for a job not claimed)
-- Returns 1 given back, 0 the job was in neither (already given back, or claimed by another worker).
local out = redis.call('LREM', KEYS[1], 1, ARGV[1])
if ARGV[2] ~= '' then out = out + redis.call('ZREM', KEYS[3], ARGV[2]) end
if out > 0 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
