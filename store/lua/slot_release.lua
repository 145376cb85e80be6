-- Free a turn's slot of a concurrency key, and wake the first live waiter (its deferred turn is made
-- due now, so the next reaper scan enqueues it).
-- A release wakes one even when its slot was gone already: another turn's acquire may have freed it
-- from a holder whose lease had moved on (this run's own next turn, say) without taking it, being
-- behind a waiter in line; then nobody else would wake that waiter until its poll. A re-sent release
-- wakes one more: harmless, a turn woken for nothing asks again and waits again.
-- Called with no slot (ARGV[1] ''), it only wakes, and only while fewer than the key's limit are held:
-- the check a turn makes once its own wait is recorded, in case the slot freed between its acquire and
-- that record (when the release found no deferred turn to wake); and an operator's new limit, which
-- wakes as many waiters as there are slots free now (ARGV[4]: at most that many).
-- KEYS[1] slots zset  KEYS[2] waiting zset  KEYS[3] wake hash  KEYS[4] ap:turns:deferred
-- KEYS[5] operator limits hash
-- ARGV[1] the slot ("<run id>|<lease token>"), or ''  ARGV[2] the concurrency key  ARGV[3] the run's
-- max_concurrency (with no slot: the operator's limit for the key wins over it)  ARGV[4] how many
-- waiters to wake at most (1 if not given)
-- Returns how many waiters were woken.
local wanted = tonumber(ARGV[4]) or 1
if ARGV[1] ~= '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  local limit = tonumber(redis.call('HGET', KEYS[5], ARGV[2]) or ARGV[3])
  if not limit or limit < 1 then return 0 end
  wanted = math.min(wanted, limit - redis.call('ZCARD', KEYS[1]))
  if wanted < 1 then return 0 end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local woken = 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, wanted + 9)) do
  local wake = redis.call('HGET', KEYS[3], m)
  local member = wake and string.match(wake, '^%d+|(.+)$')
  if member and redis.call('ZSCORE', KEYS[4], member) then
    redis.call('ZADD', KEYS[4], 'XX', now, member)
    woken = woken + 1
    if woken >= wanted then return woken end
  end
end
return woken
