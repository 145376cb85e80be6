-- What a fenced transaction (save point B, a deferral) checks after its WATCH, in one round trip:
-- the lease's holder, the run's status, attempt and requeue count, whether the transaction's write id
-- already landed (its EXEC was applied but the reply lost: redis-py raised WatchError), and the run's
-- turns and phase (save point B lands only on the save point A it follows).
-- KEYS[1] lease   KEYS[2] run header
-- ARGV[1] write id
-- Returns {holder or nil, status or nil, attempt or nil, requeues or nil, the landed result or nil,
-- turns or nil, phase or nil}.
local h = redis.call('HMGET', KEYS[2], 'status', 'attempt', 'requeues', 'turns', 'phase')
return {redis.call('GET', KEYS[1]), h[1], h[2], h[3], replayed(KEYS[2], ARGV[1]) or false, h[4], h[5]}
