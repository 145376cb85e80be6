-- The tokens a model call was billed for when its stream was cut before the message ended (the
-- connection lost, the idle timeout, an `error` event after the 200): what message_start and the
-- message_delta events had reported. Its output is never committed; its spend is, with the
-- model_cut event, exactly once: a spend id already counted (a takeover counting a call its
-- fenced-out worker counted already, or the other way round) is a no-op. Counted even when this
-- worker was fenced out meanwhile (the call was paid for, as at save point A), then the lease is
-- checked like every write of a turn. The result says whether this write counted the call, which a
-- worker that adds up the pool-wide counters itself needs to know (agentpool.store.stats): so a
-- re-delivery of the same write id returns the first delivery's result, changing nothing.
-- KEYS[1] run header   KEYS[2] lease   KEYS[3] ap:stats   KEYS[4] events   KEYS[5..] the headers of the
-- run's ancestors (a child run's spend counts in its tree's too: see _tree.lua)
-- ARGV[1] token  ARGV[2] spend id  ARGV[3..6] input, output, cache-read, cache-write tokens
-- ARGV[7] cost in USD  ARGV[8] write id  ARGV[9] the call's rest (see _rest.lua: '' but for a worker
-- counting its own call, which a takeover may have counted from its note)  ARGV[10..] the model_cut
-- event (see _event.lua)
-- Returns 1 counted, 0 already counted, 2 already counted and the rest counted here, -1 counted but
-- the lease is lost, -6 already counted and the lease is lost, -7 the same with the rest counted here,
-- -4 no such run.
local seen = replayed(KEYS[1], ARGV[8])
if seen then return tonumber(seen) end
if redis.call('EXISTS', KEYS[1]) == 0 then return -4 end
local counted = 0
local ring = spent_ring(KEYS[1])
if not spent_has(ring, ARGV[2]) then
  add_spend(KEYS[1], 3)
  roll_up_spend(KEYS[1], keys_from(5), 3)
  redis.call('HSET', KEYS[1], 'spent', spent_with(ring, ARGV[2]))
  record_event(KEYS[4], KEYS[3], 10)
  counted = 1
elseif count_rest(KEYS[1], ring, 9, keys_from(5), KEYS[4], KEYS[3]) then
  counted = 2
end
local code = counted
if redis.call('GET', KEYS[2]) ~= ARGV[1] then code = ({[1] = -1, [0] = -6, [2] = -7})[counted] end
remember(KEYS[1], ARGV[8], code)
return code
