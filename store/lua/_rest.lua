-- Prepended to the scripts that save or count a model call and may find that the turn that took the run
-- over counted that call already, from the note made as its reply began (see store/scripts.py):
--   count_rest(header, ring, at, ancestors, events, stats) -> counts what the note did not know (the
--       output written after message_start, mostly), which only the call's own worker, fenced out
--       meanwhile, can know: ARGV[at] is '' (nothing to count) or that rest, one msgpack argument (see
--       agentpool.store.spend.Rest): its spend id ('call:<API id>:rest'), its input, output, cache-read,
--       cache-write tokens and cost, then its spend_corrected event (see _event.lua). Counted in the
--       write that is refused, not in one of its own after it: a worker that dies or loses Redis between
--       the two would leave it uncounted. Once (its id goes into the run's ring `ring`), in the
--       ancestors' tree counters too (`ancestors`: their headers). Returns whether it counted here.
local function count_rest(header, ring, at, ancestors, events, stats)
  if ARGV[at] == '' then return false end
  -- One argument, unpacked only on this rare path: a save that is not refused pays for one string.
  local rest = cmsgpack.unpack(ARGV[at])
  if spent_has(ring, rest[1]) then return false end
  -- The helpers read their values from ARGV: the rest's go at its end.
  local base = #ARGV
  for i = 2, #rest do ARGV[base + i - 1] = rest[i] end
  add_spend(header, base + 1)
  roll_up_spend(header, ancestors, base + 1)
  redis.call('HSET', header, 'spent', spent_with(ring, rest[1]))
  record_event(events, stats, base + 6)
  return true
end
