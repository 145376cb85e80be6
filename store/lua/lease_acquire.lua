-- Take a run's lease for one turn: only if the run is active, the job's turn is the current one,
-- and nobody holds the lease. Bumps the fence, so every earlier owner's token is dead.
-- KEYS[1] run header (hash)   KEYS[2] lease (string)   KEYS[3] ap:runs:watch (zset)
-- ARGV[1] worker id  ARGV[2] ttl ms  ARGV[3] now ms  ARGV[4] run id  ARGV[5] turn of the job
-- ARGV[6] highest schema version this code understands
-- Returns {code, detail}:
--   1 acquired (token)   0 held by another (holder token)   -1 no such run   -2 stale (current turn)
--   -3 not active (status)   -4 schema too new (version)   -5 header unreadable (field name)
local h = redis.call('HMGET', KEYS[1], 'v', 'status', 'turns', 'phase')
if not h[1] then return {-1, ''} end
local version = tonumber(h[1])
if not version then return {-5, 'v'} end
if version > tonumber(ARGV[6]) then return {-4, h[1]} end
if h[2] ~= 'queued' and h[2] ~= 'running' then return {-3, tostring(h[2])} end
local current = tonumber(h[3])
if not current then return {-5, 'turns'} end
if h[4] == 'tools' then current = current - 1 end
if current ~= tonumber(ARGV[5]) then return {-2, tostring(current)} end
local holder = redis.call('GET', KEYS[2])
if holder then return {0, holder} end
local fence = redis.call('HINCRBY', KEYS[1], 'fence', 1)
local token = fence .. ':' .. ARGV[1]
redis.call('SET', KEYS[2], token, 'PX', ARGV[2])
redis.call('HSET', KEYS[1], 'status', 'running', 'updated_at', ARGV[3])
redis.call('ZADD', KEYS[3], tonumber(ARGV[3]) + tonumber(ARGV[2]), ARGV[4])
return {1, token}
