-- A worker takes one due webhook delivery to make it: the delivery's place in the due set moves a lease
-- ahead (so a worker killed while delivering leaves it due again once the lease ends, for any worker),
-- its attempt is counted and the claim recorded. Refused while another worker's lease on it runs.
-- A worker that cannot make it leaves it due, with a note saying why (once): one without the signing
-- secret, or without a pool default for a delivery to the pool default. A 'maybe' delivery (recorded
-- by an app's cancel, which cannot know whether the workers have a default) to the pool default is
-- dropped by a worker without one: the pool has none.
-- Safe to deliver twice: the same claim again (same token) returns the same answer, counting nothing.
-- KEYS[1] ap:webhooks:due  KEYS[2] the run's deliveries hash
-- ARGV[1] delivery id  ARGV[2] its number n  ARGV[3] lease length ms  ARGV[4] claim token
-- ARGV[5] what this worker has: 'secret', 'secret,default' or ''
-- Now is Redis's clock (TIME), never the worker's: one whose clock ran ahead would see a live lease as
-- ended and take the delivery from the worker making it (two POSTs at once, the first outcome dropped).
-- Returns {attempt, summary, result start} claimed; 0 not due (claimed by another, or done); -1 gone
-- (its run expired, or it ended: dropped from the due set); -2 dropped ('maybe', and no pool default);
-- -3 left for a worker that can make it (noted).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = ARGV[2]
if redis.call('HGET', KEYS[2], n .. ':claim') == ARGV[4] then
  local again = redis.call('HMGET', KEYS[2], n .. ':attempts', n, n .. ':result')
  return {tonumber(again[1]), again[2], again[3]}
end
local due = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not due or tonumber(due) > now then return 0 end
local h = redis.call('HMGET', KEYS[2], n, n .. ':result', n .. ':state')
if not h[1] or h[3] ~= 'pending' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return -1
end
local has = ',' .. ARGV[5] .. ','
local summary = cmsgpack.unpack(h[1])
local to_default = summary.url == nil or summary.url == ''
local can_default = string.find(has, ',default,', 1, true) ~= nil
if to_default and not can_default and summary.maybe == 1 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  for _, field in ipairs({'', ':result', ':state', ':attempts', ':claim', ':at', ':error', ':next', ':waiting'}) do
    redis.call('HDEL', KEYS[2], n .. field)
  end
  return -2
end
local missing = nil
if not string.find(has, ',secret,', 1, true) then
  missing = 'AGENTPOOL_WEBHOOK_SECRET'
elseif to_default and not can_default then
  missing = 'AGENTPOOL_WEBHOOK_URL (the pool default this delivery goes to)'
end
if missing then
  redis.call('HSETNX', KEYS[2], n .. ':waiting', 'waits for a worker with ' .. missing)
  return -3
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
local attempt = redis.call('HINCRBY', KEYS[2], n .. ':attempts', 1)
redis.call('HSET', KEYS[2], n .. ':claim', ARGV[4], n .. ':at', now)
redis.call('HDEL', KEYS[2], n .. ':waiting')
return {attempt, h[1], h[2]}
