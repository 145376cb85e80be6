-- Prepended to the scripts that count a model call's spend (see store/scripts.py):
--   add_spend(header, first, current) -> adds ARGV[first .. first+3] (input, output, cache-read,
--                               cache-write tokens) and ARGV[first+4] (cost in USD) to the run's counters
--                               in one HSET (a zero adds nothing; nothing to add costs no command).
--                               `current` is the counters' values as the caller read them, in
--                               SPEND_FIELDS' order (nil: read here, one HMGET).
local SPEND_FIELDS = {'input_tokens', 'output_tokens', 'cache_read_input_tokens', 'cache_creation_input_tokens',
  'cost_usd'}
--   spend_fields(header, first, current) -> the same as field/value pairs, written by nothing: for a
--                               caller that writes them with an HSET of its own (one command less).
local function spend_fields(header, first, current)
  local fields = {}
  for i, field in ipairs(SPEND_FIELDS) do
    local add = ARGV[first + i - 1]
    if add ~= '0' and tonumber(add) ~= 0 then  -- most calls add no cache tokens: no conversion for those
      current = current or redis.call('HMGET', header, unpack(SPEND_FIELDS))
      local total = (tonumber(current[i]) or 0) + add
      -- The tokens stay integers (HINCRBY-compatible); the cost keeps every digit a double has.
      table.insert(fields, field)
      table.insert(fields, i < 5 and string.format('%d', total) or string.format('%.17g', total))
    end
  end
  return fields
end
local function add_spend(header, first, current)
  local fields = spend_fields(header, first, current)
  if #fields > 0 then redis.call('HSET', header, unpack(fields)) end
end
--   spent_ring(header) -> the spend ids of the run's last SPENT_KEPT counts of a call by its id
--                               (space-separated, oldest first, in the header's 'spent' field).
--   spent_has(ring, spend_id) -> whether the ring holds the id (counted already).
--   spent_with(ring, spend_id) -> the ring with the id added (the oldest dropped past SPENT_KEPT):
--                               more than the last one, as a takeover may count calls of its own
--                               before the fenced-out worker that made an earlier one wakes.
local SPENT_KEPT = 8
local function spent_ring(header)
  return redis.call('HGET', header, 'spent') or ''
end
local function spent_has(ring, spend_id)
  return string.find(' ' .. ring .. ' ', ' ' .. spend_id .. ' ', 1, true) ~= nil
end
local function spent_with(ring, spend_id)
  local ids = {}
  for id in string.gmatch(ring, '%S+') do table.insert(ids, id) end
  table.insert(ids, spend_id)
  return table.concat(ids, ' ', math.max(1, #ids - SPENT_KEPT + 1))
end
--   fenced_call(header, blob) -> for a worker that lost its lease while alive (a silent connection, a
--                               pause) and saves a call's reply: the spend id the turn that took the run
--                               over counts that call under, from the note it made at message_start
--                               ('call:<API id>', see count_spend.lua; nil for a message with no id), the
--                               run's ring of counted ids, and whether that call is in it (counted already).
local function fenced_call(header, blob)
  local ok, record = pcall(cmsgpack.unpack, blob)
  local id = ok and type(record) == 'table' and type(record.meta) == 'table' and record.meta.id
  if type(id) ~= 'string' or id == '' then return nil, nil, false end
  local spend_id = 'call:' .. id
  local ring = spent_ring(header)
  return spend_id, ring, spent_has(ring, spend_id)
end
