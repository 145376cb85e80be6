-- Save point B in one call, when no message waits in the run's inbox (the common case; otherwise the
-- caller commits with its WATCH/MULTI transaction, which merges the messages into the results): the
-- tool results message, the ledger's notes of the outcomes, phase back to "model", the next turn's
-- RQ job (as the writes RQ would make, given by the caller), its events, the lease dropped. Only on the
-- save point A it follows (the run at that turn count, in phase "tools") and only for the lease's holder.
-- Safe to deliver twice: the write id goes into the header's `writes` ring with the rest; a re-delivery
-- finds it there and does nothing.
-- KEYS[1] lease   KEYS[2] run header   KEYS[3] inbox   KEYS[4] messages   KEYS[5] ledger
-- KEYS[6] ap:runs:watch   KEYS[7] events   KEYS[8] ap:stats   KEYS[9] hand-back record
-- KEYS[10] the next job's hash   KEYS[11] its RQ queue   KEYS[12] RQ's set of queues
-- KEYS[13], KEYS[14] (optional) the hash of the RQ job this turn runs in and its queue's started registry:
-- the job's end is made here too (its hash deleted, its execution out of the registry)
-- ARGV[1] token   ARGV[2] write id   ARGV[3] turn count save point A left   ARGV[4] results message blob or ''
-- ARGV[5] now ms   ARGV[6] when the reaper looks at the run next (ms)   ARGV[7] run id   ARGV[8] next job id
-- ARGV[9] 1: push the job at the head of its queue   ARGV[10] 1: add the queue to RQ's set of queues
-- then three lists, each a count and its field/value pairs: the ledger's notes, more header fields
-- (the job id, a window hint...), the job's hash; then a count of events and the events (see _event.lua);
-- last, the execution's member in that started registry ('' without KEYS[13])
-- Returns 1 committed, 0 committed by an earlier delivery, -1 lease lost, -2 not running (status),
-- -3 turn moved (turns, phase), -9 messages wait in the inbox (nothing done).
local h = redis.call('HMGET', KEYS[2], 'status', 'turns', 'phase', 'writes')
if replayed_in(h[4], ARGV[2]) then return {0} end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {-1} end
if h[1] ~= 'running' then return {-2, h[1] or ''} end
if h[2] ~= ARGV[3] or h[3] ~= 'tools' then return {-3, h[2] or '', h[3] or ''} end
if redis.call('LLEN', KEYS[3]) > 0 then return {-9} end

-- Each list of pairs is passed on as a range of ARGV (unpack(ARGV, first, last)), not copied into a table.
local at = 11
local function pairs_at()
  local first, last = at + 1, at + 2 * ARGV[at]
  at = last + 1
  return first, last
end
local notes_first, notes_last = pairs_at()
local header_first, header_last = pairs_at()
local job_first, job_last = pairs_at()

if ARGV[4] ~= '' then redis.call('RPUSH', KEYS[4], ARGV[4]) end
if notes_last >= notes_first then redis.call('HSET', KEYS[5], unpack(ARGV, notes_first, notes_last)) end
redis.call('HSET', KEYS[2], 'phase', 'model', 'pending', '', 'attempt', '0', 'updated_at', ARGV[5],
  'writes', ring_with(h[4], ARGV[2], '1'), unpack(ARGV, header_first, header_last))
redis.call('ZADD', KEYS[6], ARGV[6], ARGV[7])
if ARGV[10] == '1' then redis.call('SADD', KEYS[12], KEYS[11]) end
redis.call('HSET', KEYS[10], unpack(ARGV, job_first, job_last))
if ARGV[9] == '1' then redis.call('LPUSH', KEYS[11], ARGV[8]) else redis.call('RPUSH', KEYS[11], ARGV[8]) end
local events = ARGV[at] + 0
at = at + 1
for _ = 1, events do at = record_event(KEYS[7], KEYS[8], at) end
if KEYS[13] then
  redis.call('ZREM', KEYS[14], ARGV[at])
  redis.call('DEL', KEYS[1], KEYS[9], KEYS[13])
else
  redis.call('DEL', KEYS[1], KEYS[9])
end
return {1}
