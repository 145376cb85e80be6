-- Fenced status change that ends the turn without a next one: stopped (a limit), waiting_approval,
-- failed, or completed after the last tool results. Optionally appends one last message, stamping the
-- header with the schema version it was written in (so a worker too old to read that message finds
-- out from the header, before it touches anything). Drops the lease and any hand-back record. A run
-- that is finished for good (completed, failed) expires after the retention. Records the status
-- event with it. Safe to deliver twice: a re-delivery of the same write id returns the first result.
-- KEYS[1] run header   KEYS[2] lease   KEYS[3] messages   KEYS[4] ap:runs:watch   KEYS[5] ap:stats
-- KEYS[6] events   KEYS[7] hand-back record   KEYS[8..] the run's other keys (ledger, approvals, inbox,
-- received messages, children, joins), for the retention; then, for a child run, its parent's header,
-- joins hash and events (see _join.lua), as many as ARGV[13] says; last, the webhook's two keys (see
-- _webhook.lua: taken off first)
-- ARGV[1] token  ARGV[2] status  ARGV[3] error text  ARGV[4] now ms  ARGV[5] run id
-- ARGV[6] message blob or ''  ARGV[7] phase after ('' keeps it)  ARGV[8] result text or ''
-- ARGV[9] retention seconds (0 keeps it)  ARGV[10] watch score ('' removes the run from the watch set)
-- ARGV[11] schema version of the message  ARGV[12] write id  ARGV[13] parent keys given (0 or 3)
-- ARGV[14..] the event (see _event.lua); last, the pool default's webhook events (see _webhook.lua)
-- Returns 1 ok (2: ok, and it was the parent's last open child, which is now woken), -1 lease lost,
-- -2 run not running.
local webhook = take_webhook()
local seen = replayed(KEYS[1], ARGV[12])
if seen then return tonumber(seen) end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return -2 end
if ARGV[6] ~= '' then
  redis.call('RPUSH', KEYS[3], ARGV[6])
  redis.call('HSET', KEYS[1], 'v', ARGV[11])
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'error', ARGV[3], 'updated_at', ARGV[4])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'phase', ARGV[7], 'pending', '') end
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[8]) end
redis.call('DEL', KEYS[2])
redis.call('DEL', KEYS[7])
if ARGV[10] == '' then
  redis.call('ZREM', KEYS[4], ARGV[5])
else
  redis.call('ZADD', KEYS[4], ARGV[10], ARGV[5])
end
local joined = 1
local parent_keys = tonumber(ARGV[13])
if parent_keys > 0 and ARGV[2] ~= 'waiting_approval' and ARGV[2] ~= 'waiting_children' then
  if join_parent(KEYS[1], #KEYS - 2, KEYS[4], ARGV[5], redis.call('HGET', KEYS[1], 'parent'), ARGV[4]) == 2 then
    joined = 2
  end
end
remember(KEYS[1], ARGV[12], joined)
if ARGV[2] == 'waiting_approval' then
  -- The calls it now waits on ("<tool_use_id> <tool>", comma-separated), for its webhook: a receiver
  -- decides each by its id, never "whatever waits" by the time its decision lands. A request is
  -- `<id>:wait` in the approvals hash (KEYS[9]); a call decided (in an earlier wait) has `<id>` too.
  local fields = redis.call('HGETALL', KEYS[9])
  local decided, waiting = {}, {}
  for i = 1, #fields, 2 do decided[fields[i]] = true end
  for i = 1, #fields, 2 do
    local id = string.match(fields[i], '^(.+):wait$')
    if id and not decided[id] then
      local ok, request = pcall(cmsgpack.unpack, fields[i + 1])
      waiting[#waiting + 1] = id .. ' ' .. (ok and type(request) == 'table' and tostring(request.name) or '?')
    end
  end
  redis.call('HSET', KEYS[1], 'awaiting', table.concat(waiting, ','))
end
record_webhook(webhook, KEYS[1], ARGV[5], ARGV[2], ARGV[4])
record_event(KEYS[6], KEYS[5], 14)  -- before the retention's EXPIRE, which it must not outlive
local ttl = tonumber(ARGV[9])
if ttl > 0 then
  expire_run_keys(#KEYS - parent_keys, ttl)
end
return joined
