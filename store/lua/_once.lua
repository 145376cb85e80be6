-- Prepended to the scripts that must be safe to deliver twice (see store/writes.py and store/scripts.py).
-- redis-py re-sends a script whose reply was lost (retry_on_error), so a script that is not idempotent
-- by nature takes a write id (12 hex characters, one per logical write, ARGV) and:
--   replayed(hash, id[, field])         -> the result the first delivery recorded, or nil if it never landed
--   remember(hash, id, result[, field]) -> records it, in `field` of `hash` (a run's header, or a run's
--                                          hand-back record): "<id>=<result>;" newest first, the last 16
-- Two rings in a run's header: `writes` for the writes of the turn holding the lease, which makes them
-- one at a time (a re-send comes before its next write), and `writes_others` for everybody else (an
-- app's messages, approvals, cancels; the reaper; events), so that a burst of those can never push a
-- save point's id out before its re-send arrives (the re-send would count the call's spend twice).
-- An empty id skips both (a caller that does not need it).
-- A script that has read the field already (with the header's other fields, one HMGET) uses
-- replayed_in(recent, id) and ring_with(recent, id, result), the value to write back with its own HSET.
local WRITES_KEPT = 16
local function replayed_in(recent, id)
  if id == '' or not recent then return nil end
  -- An id counts only at an entry's start: the ring's first, or right after a ';' (plain finds, no
  -- copy of the ring).
  local key = id .. '='
  local at = string.sub(recent, 1, #key) == key and 1 or string.find(recent, ';' .. key, 1, true)
  if not at then return nil end
  if at > 1 then at = at + 1 end
  return string.match(recent, '^([^;]*)', at + #key)
end
local function replayed(hash, id, field)
  if id == '' then return nil end
  return replayed_in(redis.call('HGET', hash, field or 'writes'), id)
end
local function ring_with(recent, id, result)
  local ring = id .. '=' .. tostring(result) .. ';' .. (recent or '')
  -- Cut after the WRITES_KEPT-th ';' (a plain find per entry: a pattern would try every character).
  local pos = 0
  for _ = 1, WRITES_KEPT do
    pos = string.find(ring, ';', pos + 1, true)
    if not pos then return ring end
  end
  return string.sub(ring, 1, pos)
end
local function remember(hash, id, result, field)
  if id == '' then return end
  field = field or 'writes'
  redis.call('HSET', hash, field, ring_with(redis.call('HGET', hash, field), id, result))
end
