-- The durability guard's probe write (store/durability.py), sent on one connection with the WAIT (and
-- WAITAOF) that follows it: it increments the probe counter only where the writes the guard protects
-- are: the turn's lease, the run at the turn and phase its save point A left, and the call's intent as
-- this turn wrote it. A replica that acknowledges the probe then has all of them (replication is
-- ordered). On a server that lacks them (a promoted replica behind an endpoint that followed the
-- failover, a primary restarted without them) it writes nothing, and the guard refuses the call.
-- KEYS[1] lease   KEYS[2] run header   KEYS[3] ledger   KEYS[4] ap:durability:probe
-- ARGV[1] token  ARGV[2] the run's turns  ARGV[3] its phase  ARGV[4] intent field  ARGV[5] intent blob
-- Returns 1 (probe incremented), -1 lease not held, -2 run not running, -3 the run is at another turn
-- or phase, -4 the intent is missing or not this attempt's.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local h = redis.call('HMGET', KEYS[2], 'status', 'turns', 'phase')
if h[1] ~= 'running' then return -2 end
if h[2] ~= ARGV[2] or h[3] ~= ARGV[3] then return -3 end
if redis.call('HGET', KEYS[3], ARGV[4]) ~= ARGV[5] then return -4 end
redis.call('INCR', KEYS[4])
return 1
