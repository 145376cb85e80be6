-- Save point A: the model's response is committed before any tool runs. First counts what the call
-- cost (tokens, USD) with its model_responded event: the call was made and billed, so that counts
-- even if the response can no longer be committed (the run was cancelled meanwhile, or this worker
-- was fenced out: a zombie's call is paid for too). Then counts the turn, appends the assistant
-- message, records its tool_use blocks as pending, clears a hand-back record (this worker could do
-- the turn; a record can only be there if a re-enqueue brought the turn), and stamps the header with
-- the current schema version (an older header was migrated in memory when it was loaded). With a final
-- status (the model asked for no tool, or the reply ends the run: a refusal, or a full context window
-- that stops it...), ends the run in the same step and drops the lease; a closing message then answers
-- the reply's tool_uses (not run), so the conversation stays valid.
-- Safe to deliver twice: a re-delivery of the same write id returns the first result, counting nothing.
-- KEYS[1] run header   KEYS[2] lease   KEYS[3] messages   KEYS[4] ap:runs:watch   KEYS[5] ap:stats
-- KEYS[6] events   KEYS[7] hand-back record   KEYS[8..] the run's other keys (ledger, approvals, inbox,
-- received messages, children, joins), for the retention; KEYS[10] is the inbox; then, for a child
-- run, its tree keys, as many as ARGV[19] says: its parent's header, joins hash, events, inbox and
-- received hash (see _join.lua), then the headers of the ancestors above the parent (see _tree.lua)
-- last, the webhook's two keys (see _webhook.lua: taken off first)
-- ARGV[1] token  ARGV[2] turns before this call  ARGV[3] assistant message blob  ARGV[4] pending blob
-- ARGV[5] now ms  ARGV[6] run id  ARGV[7] final status or ''  ARGV[8] result text  ARGV[9] error text
-- ARGV[10] schema version  ARGV[11] retention seconds for a finished run (0 keeps it)
-- ARGV[12..15] input, output, cache-read, cache-write tokens  ARGV[16] cost in USD  ARGV[17] write id
-- ARGV[18] closing message blob or ''  ARGV[19] tree keys given (0 for a run without a parent)
-- ARGV[20] id and ARGV[21] content blob of the child's answer for its parent, given when the reply
-- completes a child run ('' otherwise): queued in the parent's inbox if the parent's join had ended
-- before (see _join.lua)  ARGV[22] '1' to delete the hand-back record ('' when the caller knows there is
-- none: a turn no re-enqueue brought, after the save point B that deleted the last)
-- ARGV[23] the index the header's window moves to ('' leaves it): this reply's own index when the API
-- compacted the conversation in it, or the compaction point the turn loaded its window from when the
-- header lagged behind it. Moved here, not only by save point B: a reply that ends the run (a chat with
-- no tool call) has no save point B, and every later turn would read the whole conversation again.
-- ARGV[24] the call's rest (see _rest.lua: counted when a takeover counted the call from its note)
-- ARGV[25..] two events (see _event.lua): the model_responded one, then the one reporting the commit;
-- then n, n pairs of a ledger field (a tool_use id) and its intent blob, and n events (their
-- tool_started): the intents of read tools the worker runs right after this commit, so that they need
-- no fenced write of their own (written only when the reply is committed as a turn that goes on; n is
-- 0 otherwise)
-- last, the pool default's webhook events (see _webhook.lua)
-- Returns 1 ok (2: ok, the run ended and was its parent's last open child, now woken), -1 lease lost, -2 run not running (status changed under us), -3 stale turn (each of
-- these three with the spend counted), -4 no such run (nothing counted), -5 the reply would complete
-- the run but messages wait in its inbox (nothing counted, nothing changed: the caller commits the
-- reply as a turn that goes on, and its save point B delivers them), -6 lease lost and the call
-- counted already, from its note, by the attempt that took the run over (nothing counted or reported:
-- no model_responded event, no pool-wide counter), -7 the same, and the rest of the call (what its note
-- did not know) counted here with its spend_corrected event.
local webhook = take_webhook()
local h = redis.call('HMGET', KEYS[1], 'status', 'turns', 'phase', 'writes', unpack(SPEND_FIELDS))
local seen = replayed_in(h[4], ARGV[17])
if seen then return tonumber(seen) end
if not h[1] then return -4 end
if ARGV[7] == 'completed' and redis.call('LLEN', KEYS[10]) > 0 then return -5 end
local parent_keys = tonumber(ARGV[19])
local leased = redis.call('GET', KEYS[2]) == ARGV[1]
-- The spend rides in whichever HSET of the header comes next (a refusal's, or the turn's), the same
-- script either way; a child run writes it at once, for its join with its parent reads it.
local spend = spend_fields(KEYS[1], 12, {h[5], h[6], h[7], h[8], h[9]})
if not leased then
  -- This worker lost its lease while alive: the attempt that took the run over may have counted this
  -- very call already, from its note. Counted once: here only if that has not been.
  local call_spend, ring, counted = fenced_call(KEYS[1], ARGV[3])
  if counted then  -- and reported, with its model_cut event and the pool-wide counters: only its rest here
    local above = parent_keys > 0 and ancestor_headers(#KEYS - parent_keys + 1, 5) or {}
    local code = count_rest(KEYS[1], ring, 24, above, KEYS[6], KEYS[5]) and -7 or -6
    redis.call('HSET', KEYS[1], 'writes', ring_with(h[4], ARGV[17], code))
    return code
  end
  if call_spend and #spend > 0 then  -- counted here: a takeover that reads the note later does not count it
    table.insert(spend, 'spent')
    table.insert(spend, spent_with(ring, call_spend))
  end
end
if parent_keys > 0 then
  if #spend > 0 then redis.call('HSET', KEYS[1], unpack(spend)) end
  spend = {}
  roll_up_spend(KEYS[1], ancestor_headers(#KEYS - parent_keys + 1, 5), 12)
end
local committed_event = record_event(KEYS[6], KEYS[5], 25)
local function refused(code)
  redis.call('HSET', KEYS[1], 'writes', ring_with(h[4], ARGV[17], code), unpack(spend))
  return code
end
if not leased then return refused(-1) end
if h[1] ~= 'running' then return refused(-2) end
if h[2] ~= ARGV[2] or h[3] ~= 'model' then return refused(-3) end
redis.call('RPUSH', KEYS[3], ARGV[3])
local joined = 1
if ARGV[7] ~= '' and parent_keys > 0 then
  local up = #KEYS - parent_keys + 1
  if join_parent(KEYS[1], up, KEYS[4], ARGV[6], redis.call('HGET', KEYS[1], 'parent'), ARGV[5], ARGV[20], ARGV[21], ARGV[7]) == 2 then
    joined = 2
  end
end
if ARGV[23] ~= '' then  -- rides in the HSET below with the spend
  table.insert(spend, 'window')
  table.insert(spend, ARGV[23])
end
-- One HSET: the turn counted, the reply's tool_uses pending, the schema stamped, this write's id kept.
redis.call('HSET', KEYS[1], 'turns', h[2] + 1, 'phase', 'tools', 'pending', ARGV[4], 'model_errors', '0',
  'updated_at', ARGV[5], 'v', ARGV[10], 'writes', ring_with(h[4], ARGV[17], joined), unpack(spend))
if ARGV[22] == '1' then redis.call('DEL', KEYS[7]) end
local after = record_event(KEYS[6], KEYS[5], committed_event)  -- before the retention's EXPIRE, which it must not outlive
local intents = tonumber(ARGV[after]) or 0
if intents > 0 then
  redis.call('HSET', KEYS[8], unpack(ARGV, after + 1, after + 2 * intents))
  after = after + 2 * intents + 1
  for _ = 1, intents do after = record_event(KEYS[6], KEYS[5], after) end
end
if ARGV[7] ~= '' then
  if ARGV[18] ~= '' then redis.call('RPUSH', KEYS[3], ARGV[18]) end
  -- A stopped run (the context window is full) resumes with a model call; a finished one is done.
  local phase = ARGV[7] == 'stopped' and 'model' or 'done'
  redis.call('HSET', KEYS[1], 'status', ARGV[7], 'phase', phase, 'pending', '', 'result', ARGV[8], 'error', ARGV[9])
  record_webhook(webhook, KEYS[1], ARGV[6], ARGV[7], ARGV[5])
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[4], ARGV[6])
  local ttl = tonumber(ARGV[11])
  if ttl > 0 then
    expire_run_keys(#KEYS - parent_keys, ttl)
  end
end
return joined
