-- Fallback compaction's save: the summary of the window, written by the model in a call of its own,
-- becomes the message the next request starts from. Counts that call's tokens and cost first with the
-- compacted event (the call was made and billed, so it counts even when the summary can no longer be
-- saved: a fenced-out zombie's call is paid for too, as at save point A), then appends the summary and
-- moves the header's window to it, in one step: a crash leaves the old window or the new one, never a mix.
-- Safe to deliver twice: a re-delivery of the same write id returns the first result, counting nothing.
-- KEYS[1] run header   KEYS[2] lease   KEYS[3] messages   KEYS[4] ap:stats   KEYS[5] events
-- KEYS[6..] the headers of the run's ancestors (a child run's spend counts in its tree's too: _tree.lua)
-- ARGV[1] token  ARGV[2] turns before this turn's model call  ARGV[3] the index the summary takes
-- ARGV[4] summary message blob  ARGV[5] now ms  ARGV[6..9] input, output, cache-read, cache-write tokens
-- ARGV[10] cost in USD  ARGV[11] write id  ARGV[12] the call's rest (see _rest.lua)  ARGV[13..] the
-- compacted event (see _event.lua)
-- Returns 1 saved, -1 lease lost, -2 run not running, -3 stale (each with the spend counted),
-- -4 no such run (nothing counted), -6 lease lost and the call counted already, from its note, by the
-- attempt that took the run over (nothing counted or reported, as at save point A), -7 the same but
-- the rest of the call counted here.
local seen = replayed(KEYS[1], ARGV[11])
if seen then return tonumber(seen) end
if redis.call('EXISTS', KEYS[1]) == 0 then return -4 end
local function done(code)
  remember(KEYS[1], ARGV[11], code)
  return code
end
local leased = redis.call('GET', KEYS[2]) == ARGV[1]
if not leased then  -- counted once with the takeover's count of this call's note (see commit_response.lua)
  local call_spend, ring, counted = fenced_call(KEYS[1], ARGV[4])
  if counted then return done(count_rest(KEYS[1], ring, 12, keys_from(6), KEYS[5], KEYS[4]) and -7 or -6) end
  if call_spend then redis.call('HSET', KEYS[1], 'spent', spent_with(ring, call_spend)) end
end
add_spend(KEYS[1], 6)
roll_up_spend(KEYS[1], keys_from(6), 6)
record_event(KEYS[5], KEYS[4], 13)
if not leased then return done(-1) end
local h = redis.call('HMGET', KEYS[1], 'status', 'turns', 'phase')
if h[1] ~= 'running' then return done(-2) end
local length = redis.call('LLEN', KEYS[3])
if h[2] ~= ARGV[2] or h[3] ~= 'model' or tostring(length) ~= ARGV[3] then return done(-3) end
redis.call('RPUSH', KEYS[3], ARGV[4])
redis.call('HSET', KEYS[1], 'window', ARGV[3], 'updated_at', ARGV[5])
return done(1)
