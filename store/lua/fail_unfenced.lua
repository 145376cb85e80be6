-- Fail a run without holding its lease: its records are unreadable, or its turn keeps dying. Touches
-- only the status, error and update time (the rest of the record is left as found, for a person to
-- look at), drops the lease and takes the run out of the watch set. A run that is already finished
-- (completed, failed, cancelled) keeps its status: a cancel is never turned into a failure. A child
-- run tells its parent in the same step (see _join.lua).
-- Idempotent: a re-delivery finds the run failed and changes nothing.
-- KEYS[1] run header   KEYS[2] lease   KEYS[3] ap:runs:watch   KEYS[4..] the run's other keys, for the
-- retention; then, for a child run, its parent's header, joins hash and events, as many as ARGV[5] says;
-- last, the webhook's two keys (see _webhook.lua: taken off first)
-- ARGV[1] reason  ARGV[2] now ms  ARGV[3] run id  ARGV[4] retention seconds (0 keeps it)
-- ARGV[5] parent keys given (0 or 3)  ARGV[6] the pool default's webhook events (see _webhook.lua)
-- Returns 1 failed now, 0 left alone (no such run, or already finished).
local webhook = take_webhook()
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'completed' or status == 'failed' or status == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'error', ARGV[1], 'updated_at', ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[3])
record_webhook(webhook, KEYS[1], ARGV[3], 'failed', ARGV[2])
local parent_keys = tonumber(ARGV[5]) or 0
if parent_keys > 0 then
  join_parent(KEYS[1], #KEYS - 2, KEYS[3], ARGV[3], redis.call('HGET', KEYS[1], 'parent'), ARGV[2])
end
local ttl = tonumber(ARGV[4])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  for i = 4, #KEYS - parent_keys do redis.call('EXPIRE', KEYS[i], ttl) end
end
return 1
