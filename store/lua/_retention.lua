-- Prepended to the scripts that end a run (see store/scripts.py):
--   expire_run_keys(last, ttl) -> the retention: EXPIRE on a run's keys as commit_response and finish lay
--                                 them out (KEYS[1] header, KEYS[3] messages, KEYS[6..last]: events,
--                                 hand-back record, ledger, approvals, inbox, received, children, joins,
--                                 webhooks). The header, messages, events and ledger get theirs at once;
--                                 the keys a run often never had (a hand-back, approvals, messages
--                                 sent to it, children, webhooks) are asked one EXISTS together first:
--                                 an EXPIRE on a key that is not there does nothing, but costs a command.
local function expire_run_keys(last, ttl)
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[3], ttl)
  local maybe = {}
  for i = 6, last do
    if i == 6 or i == 8 then redis.call('EXPIRE', KEYS[i], ttl) else maybe[#maybe + 1] = KEYS[i] end
  end
  if #maybe > 0 and redis.call('EXISTS', unpack(maybe)) > 0 then
    for _, key in ipairs(maybe) do redis.call('EXPIRE', key, ttl) end
  end
end
