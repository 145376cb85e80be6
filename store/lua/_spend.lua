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
--   fenced_call(header, blob) -> for a worker that lost its lease while alive (a silent connection, a
--                               pause) and saves a call's reply: the spend id the turn that took the run
--                               over counts that call under, from the note it made at message_start
--                               ('call:<API id>', see count_spend.lua; nil for a message with no id), and
--                               whether the run's last count was that call's (counted already).
local function fenced_call(header, blob)
  local ok, record = pcall(cmsgpack.unpack, blob)
  local id = ok and type(record) == 'table' and type(record.meta) == 'table' and record.meta.id
  if type(id) ~= 'string' or id == '' then return nil, false end
  local spend_id = 'call:' .. id
  return spend_id, redis.call('HGET', header, 'spent') == spend_id
end
