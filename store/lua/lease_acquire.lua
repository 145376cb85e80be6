-- Take a run's lease for one turn: only if the run is active, the job's turn is the current one,
-- and nobody holds the lease. Raises the fence, so every earlier owner's token is dead.
-- Records the turn_started event when the turn is to call the model (not when it settles the tools
-- a dead worker left pending).
-- Safe to deliver twice: the request id is kept in the header (`acq`); a re-delivery of the request
-- that took the lease finds it there and answers as the first delivery did (the same token, no new
-- fence, no second event) instead of "held by someone" (itself).
-- Reserves the turn's model call in the pool's rate-limit budget when asked (the call's need came with
-- the job: the turn before knew it), saving the turn a round trip and a script of its own; not for a
-- turn that settles tools first (it calls no model).
-- KEYS[1] run header (hash)   KEYS[2] lease (string)   KEYS[3] ap:runs:watch (zset)
-- KEYS[4] events (stream)   KEYS[5] ap:stats (hash)   KEYS[6..10] limit_reserve's KEYS, when reserving
-- ARGV[1] worker id  ARGV[2] ttl ms  ARGV[3] now ms  ARGV[4] run id  ARGV[5] turn of the job
-- ARGV[6] highest schema version this code understands  ARGV[7] request id
-- ARGV[8] n: 0, or the count of limit_reserve's ARGV that follow (ARGV[9..8+n]) to reserve the call
-- ARGV[9+n..] the event (see _event.lua)
-- Returns {code, detail[, event recorded[, limit_reserve's reply...]]}:
--   1 acquired (token, 1 if it recorded the event, what reserving answered if it did)
--   0 held by another (holder token)   -1 no such run   -2 stale (current turn)
--   -3 not active (status)   -4 schema too new (version)   -5 header unreadable (field name)
-- A re-delivery reserves again under the same reservation id: limit_reserve answers it as it did first.
local n = tonumber(ARGV[8])
local h = redis.call('HMGET', KEYS[1], 'v', 'status', 'turns', 'phase', 'acq', 'fence')
if not h[1] then return {-1, ''} end
local function acquired(token, recorded, now)
  if n == 0 or h[4] == 'tools' then return {1, token, recorded} end
  local reply = reserve_budget(KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], {unpack(ARGV, 9, 8 + n)}, now)
  return {1, token, recorded, unpack(reply)}
end
if h[5] == ARGV[7] then
  local mine = tostring(h[6]) .. ':' .. ARGV[1]
  local holder = redis.call('GET', KEYS[2])
  if holder == mine then return acquired(mine, 0) end
  return {0, holder or ''}  -- ours, but lost since (expired, released): as good as held by another
end
local version = tonumber(h[1])
if not version then return {-5, 'v'} end
if version > tonumber(ARGV[6]) then return {-4, h[1]} end
if h[2] ~= 'queued' and h[2] ~= 'running' then return {-3, tostring(h[2])} end
local current = tonumber(h[3])
if not current then return {-5, 'turns'} end
if h[4] == 'tools' then current = current - 1 end
if current ~= tonumber(ARGV[5]) then return {-2, tostring(current)} end
-- The fence is never lower than this server's clock in ms: a failover can lose the writes that handed
-- out the last fences, and counting on from what the promoted replica has would hand one out again
-- (the same "<fence>:<worker>" token to a worker that took the same run twice). The new primary's
-- clock is past every fence handed out before the failover, as long as clocks are within the failover
-- time of each other (seconds). Milliseconds keep the number exact in Lua's doubles and in tostring.
local clock = redis.call('TIME')
local now_fence = clock[1] * 1000 + math.floor(clock[2] / 1000)
-- Made a string once: the token and the header take it as it is (each number given to Redis or joined
-- to a string is formatted again).
local fence = tostring(math.max((tonumber(h[6]) or 0) + 1, now_fence))
local token = fence .. ':' .. ARGV[1]
-- NX: the lease is taken only if nobody holds it (one command where a GET and a SET would be two; the
-- holder is read only in the rare case that it is held).
if not redis.call('SET', KEYS[2], token, 'NX', 'PX', ARGV[2]) then return {0, redis.call('GET', KEYS[2]) or ''} end
redis.call('HSET', KEYS[1], 'fence', fence, 'status', 'running', 'updated_at', ARGV[3], 'acq', ARGV[7])
redis.call('ZADD', KEYS[3], ARGV[3] + ARGV[2], ARGV[4])
if h[4] == 'tools' or ARGV[9 + n] == '0' then return acquired(token, 0, now_fence) end
record_event(KEYS[4], KEYS[5], 9 + n)
return acquired(token, 1, now_fence)
