-- The outcome of one attempt at a webhook delivery. 'delivered' (the receiver answered 2xx) is recorded
-- whoever made it, even a worker whose claim ran out meanwhile: the receiver has it. 'retry' (due again
-- ARGV[5] ms from now) and 'undelivered' (given up: too old) count only from the worker that still holds the
-- claim; a late one, whose delivery another worker took over, changes nothing.
-- Idempotent: applying it again leaves what applying it once did (a retry's due time counted anew).
-- KEYS[1] ap:webhooks:due  KEYS[2] the run's deliveries hash
-- ARGV[1] delivery id  ARGV[2] its number n  ARGV[3] claim token  ARGV[4] outcome
-- ARGV[5] due again in (ms, for 'retry')  ARGV[6] error text (the failure, for 'retry' and 'undelivered')
-- Times are Redis's clock (TIME), as the claims' leases are (webhook_claim.lua).
-- Returns 1 recorded, 0 not (the claim moved on, or it was delivered already).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = ARGV[2]
local state = redis.call('HGET', KEYS[2], n .. ':state')
if ARGV[4] == 'delivered' then
  if state == 'delivered' then return 0 end
  if state then redis.call('HSET', KEYS[2], n .. ':state', 'delivered', n .. ':done', now) end
  redis.call('HDEL', KEYS[2], n .. ':next')
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
if state ~= 'pending' or redis.call('HGET', KEYS[2], n .. ':claim') ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[2], n .. ':error', ARGV[6])
if ARGV[4] == 'undelivered' then
  redis.call('HSET', KEYS[2], n .. ':state', 'undelivered', n .. ':done', now)
  redis.call('HDEL', KEYS[2], n .. ':next')
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  local due_at = now + tonumber(ARGV[5])
  redis.call('HSET', KEYS[2], n .. ':next', due_at)
  redis.call('ZADD', KEYS[1], due_at, ARGV[1])
end
return 1
