-- Put a job a worker dequeued but will not run (a stop came first) back at the head of its queue.
-- Conditional on taking it out of RQ's intermediate queue, so that a call delivered twice (its reply
-- lost, the client re-sending) pushes it once.
-- KEYS[1] RQ's intermediate queue (rq:queue:<name>:intermediate)   KEYS[2] the queue (rq:queue:<name>)
-- ARGV[1] job id
-- Returns 1 given back, 0 the job was not in the intermediate queue (already given back, or claimed).
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
