-- A turn given back on purpose: this worker cannot do it (no encryption key, a key it does not have,
-- a record newer than its code, an agent it cannot import) but another worker may. Not a crash: it
-- counts no attempt. Records why in the run's hand-back record (not in its header, which a worker
-- too old for it must leave untouched): the reason, the worker, since when (the first hand-back of
-- this reason in a row), how many in a row, and until when the turn waits. Drops the lease if the
-- turn held it, and makes the run due in the watch set at that time: the reaper re-enqueues the turn
-- then, so a misconfigured worker backs off (doubling up to a cap) instead of spinning on it. The
-- first save point a worker makes deletes the record. A turn that must wait for a fixed time (a call
-- another worker started may still be running until then) gives that time instead of the backoff.
-- Safe to deliver twice: a re-delivery of the same write id returns the first result.
-- KEYS[1] run header   KEYS[2] lease   KEYS[3] ap:runs:watch   KEYS[4] hand-back record
-- KEYS[5] events   KEYS[6] ap:stats
-- ARGV[1] lease token ('' if the turn never took the lease)  ARGV[2] reason  ARGV[3] detail
-- ARGV[4] worker  ARGV[5] now ms  ARGV[6] run id  ARGV[7] the job handed back  ARGV[8] first delay ms
-- ARGV[9] longest delay ms  ARGV[10] write id  ARGV[11] the time to wait until (ms), or '' for the backoff
-- ARGV[12..] the event (see _event.lua)
-- Returns "<until ms>:<since ms>:<count>", or "-1" if the lease was no longer the turn's, or the run
-- has ended or is gone (nothing recorded: a record on an ended run would outlive its retention).
local seen = replayed(KEYS[4], ARGV[10])
if seen then return seen end
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return '-1' end
local ended = redis.call('HGET', KEYS[1], 'status')
if not ended or ended == 'completed' or ended == 'failed' or ended == 'cancelled' then
  if ARGV[1] ~= '' then redis.call('DEL', KEYS[2]) end
  return '-1'
end
local now = tonumber(ARGV[5])
local last = redis.call('HMGET', KEYS[4], 'reason', 'since', 'count')
local since = now
if last[1] == ARGV[2] and tonumber(last[2]) then since = tonumber(last[2]) end
local count = (tonumber(last[3]) or 0) + 1
local delay = math.min(tonumber(ARGV[9]), tonumber(ARGV[8]) * 2 ^ math.min(count - 1, 30))
local due = tonumber(ARGV[11]) or (now + math.floor(delay))
redis.call('HSET', KEYS[4], 'reason', ARGV[2], 'detail', ARGV[3], 'worker', ARGV[4], 'since', since,
  'count', count, 'until', due, 'job', ARGV[7], 'last', now)
if ARGV[1] ~= '' then redis.call('DEL', KEYS[2]) end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'queued' or status == 'running' then redis.call('ZADD', KEYS[3], due, ARGV[6]) end
record_event(KEYS[5], KEYS[6], 12)
local result = string.format('%d:%d:%d', due, since, count)
remember(KEYS[4], ARGV[10], result)
return result
