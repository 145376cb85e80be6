-- A progress event that reports no write of its own (takeover, reconciled, model_error...), with its
-- pool-wide counters. Safe to deliver twice: a re-delivery of the same write id records nothing, so
-- the counters behind /metrics never count one event twice. An event for a run whose header is gone
-- (expired after its retention) is dropped: it would recreate a stream nothing expires.
-- KEYS[1] run header   KEYS[2] events   KEYS[3] ap:stats
-- ARGV[1] write id  ARGV[2..] the event (see _event.lua)
-- Returns 1 recorded, 0 not (a re-delivery, or no such run).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if replayed(KEYS[1], ARGV[1], 'writes_others') then return 0 end
record_event(KEYS[2], KEYS[3], 2)
remember(KEYS[1], ARGV[1], 1, 'writes_others')
return 1
