-- Take a run's lease for one turn: only if the run is active, the job's turn is the current one,
-- and nobody holds the lease. Raises the fence, so every earlier owner's token is dead.
-- Records the turn_started event when the turn is to call the model (not when it settles the tools
-- a dead worker left pending).
-- Safe to deliver twice: the request id is kept in the header (`acq`); a re-delivery of the request
-- that took the lease finds it there and answers as the first delivery did (the same token, no new
-- fence, no second event) instead of "held by someone" (itself).
-- With ARGV[8] = 1 a taken lease comes with what the turn reads next, in the same call: the header as
-- it now is, the window of messages it sends (from the header's `window` on: see store/window.py) and
-- whether somebody watches the run live.
-- KEYS[1] run header (hash)   KEYS[2] lease (string)   KEYS[3] ap:runs:watch (zset)
-- KEYS[4] events (stream)   KEYS[5] ap:stats (hash)   KEYS[6] messages (list)   KEYS[7] watchers (string)
-- ARGV[1] worker id  ARGV[2] ttl ms  ARGV[3] now ms  ARGV[4] run id  ARGV[5] turn of the job
-- ARGV[6] highest schema version this code understands  ARGV[7] request id  ARGV[8] 1: load the run too
-- ARGV[9..] the event (see _event.lua)
-- Returns {code, detail[, event recorded[, header field/value list, window start, window blobs, watched]]}:
--   1 acquired (token, 1 if it recorded the event)   0 held by another (holder token)   -1 no such run   -2 stale (current turn)
--   -3 not active (status)   -4 schema too new (version)   -5 header unreadable (field name)
local flat = redis.call('HGETALL', KEYS[1])
local h = {}
for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end

local function taken(token, recorded)
  if ARGV[8] ~= '1' then return {1, token, recorded} end
  local out = {}
  for field, value in pairs(h) do out[#out + 1] = field; out[#out + 1] = value end
  local start = tonumber(h['window'] or '0') or 0
  return {1, token, recorded, out, start, redis.call('LRANGE', KEYS[6], start, -1), redis.call('EXISTS', KEYS[7])}
end

if not h['v'] then return {-1, ''} end
if h['acq'] == ARGV[7] then
  local mine = tostring(h['fence']) .. ':' .. ARGV[1]
  local holder = redis.call('GET', KEYS[2])
  if holder == mine then return taken(mine, 0) end
  return {0, holder or ''}  -- ours, but lost since (expired, released): as good as held by another
end
local version = tonumber(h['v'])
if not version then return {-5, 'v'} end
if version > tonumber(ARGV[6]) then return {-4, h['v']} end
if h['status'] ~= 'queued' and h['status'] ~= 'running' then return {-3, tostring(h['status'])} end
local current = tonumber(h['turns'])
if not current then return {-5, 'turns'} end
if h['phase'] == 'tools' then current = current - 1 end
if current ~= tonumber(ARGV[5]) then return {-2, tostring(current)} end
local holder = redis.call('GET', KEYS[2])
if holder then return {0, holder} end
-- The fence is never lower than this server's clock in ms: a failover can lose the writes that handed
-- out the last fences, and counting on from what the promoted replica has would hand one out again
-- (the same "<fence>:<worker>" token to a worker that took the same run twice). The new primary's
-- clock is past every fence handed out before the failover, as long as clocks are within the failover
-- time of each other (seconds). Milliseconds keep the number exact in Lua's doubles and in tostring.
local clock = redis.call('TIME')
local now_fence = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local fence = math.max((tonumber(h['fence']) or 0) + 1, now_fence)
local token = fence .. ':' .. ARGV[1]
redis.call('SET', KEYS[2], token, 'PX', ARGV[2])
redis.call('HSET', KEYS[1], 'fence', fence, 'status', 'running', 'updated_at', ARGV[3], 'acq', ARGV[7])
h['fence'], h['status'], h['updated_at'], h['acq'] = tostring(fence), 'running', ARGV[3], ARGV[7]
redis.call('ZADD', KEYS[3], tonumber(ARGV[3]) + tonumber(ARGV[2]), ARGV[4])
if h['phase'] == 'tools' or ARGV[9] == '0' then return taken(token, 0) end
record_event(KEYS[4], KEYS[5], 9)
return taken(token, 1)
