-- Prepended to the scripts that end a run or make it wait for a person (see store/scripts.py and
-- store/webhooks.py). A completion webhook's delivery is recorded by the very write that changes the
-- status, so a worker killed right after it still leaves the delivery for another worker to make.
-- take_webhook() takes the webhook's keys off the end of KEYS (the run's deliveries hash, then
-- ap:webhooks:due) and its argument off the end of ARGV (the events the writer's pool default wants:
-- 'ended', 'ended,waiting_approval'...; '' none; 'maybe' from a process that cannot know the workers'
-- default, an app cancelling a run), so that every position the script reads stays as it was: call it
-- before anything else.
-- record_webhook(w, header, run_id, status, now) records a delivery when the run's own webhook (header
-- fields webhook, webhook_events) wants the event, or the run has none and the pool default wants it:
-- the event is 'waiting_approval' for that status, 'ended' for any other (completed, failed, stopped,
-- cancelled). Recorded: the run's summary as of now (msgpack) under the delivery's number n, the first
-- RESULT_BYTES of its result beside it, state pending, and the delivery's id in the due set, due now.
-- Call it after the status is written and before the retention's EXPIRE. Returns n, or 0.
local WEBHOOK_RESULT_BYTES = 40000  -- the 10,000 characters a body carries, at up to 4 bytes each
local function take_webhook()
  local pool = table.remove(ARGV)
  local due = table.remove(KEYS)
  return {deliveries = table.remove(KEYS), due = due, pool = pool}
end
local function record_webhook(w, header, run_id, status, now)
  local event = status == 'waiting_approval' and 'waiting_approval' or 'ended'
  local own = redis.call('HMGET', header, 'webhook', 'webhook_events')
  local maybe = not own[1] and w.pool == 'maybe'
  local wants = own[1] and (own[2] or 'ended') or (maybe and 'ended') or w.pool or ''
  if not string.find(',' .. wants .. ',', ',' .. event .. ',', 1, true) then return 0 end
  local n = redis.call('HINCRBY', header, 'webhook_n', 1)
  -- Made here, not at the helper's top (see store/scripts.py).
  local WEBHOOK_FIELDS = {'agent', 'turns', 'error', 'queue', 'parent', 'created_at', 'cost_usd', 'tree_cost_usd',
    'input_tokens', 'output_tokens', 'cache_read_input_tokens', 'cache_creation_input_tokens',
    'tree_input_tokens', 'tree_output_tokens', 'tree_cache_read_input_tokens', 'tree_cache_creation_input_tokens',
    'awaiting'}
  local values = redis.call('HMGET', header, unpack(WEBHOOK_FIELDS))
  local summary = {event = event, status = status, at = tonumber(now), url = own[1] or '', maybe = maybe and 1 or 0}
  for i, name in ipairs(WEBHOOK_FIELDS) do
    if values[i] then summary[name] = values[i] end
  end
  if event ~= 'waiting_approval' then summary.awaiting = nil end  -- left from an earlier wait
  local result = redis.call('HGET', header, 'result') or ''
  summary.result_bytes = #result
  local id = run_id .. '.' .. (summary.created_at or '0') .. '.' .. n
  summary.id = id
  redis.call('HSET', w.deliveries, n, cmsgpack.pack(summary), n .. ':result', string.sub(result, 1, WEBHOOK_RESULT_BYTES),
    n .. ':state', 'pending', n .. ':attempts', 0)
  redis.call('ZADD', w.due, now, id)
  return n
end
