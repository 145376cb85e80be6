-- What save point B's transaction checks after its WATCH, in one round trip: the lease's holder,
-- and the run's status and attempt.
-- KEYS[1] lease   KEYS[2] run header
-- Returns {holder or nil, status or nil, attempt or nil}.
local h = redis.call('HMGET', KEYS[2], 'status', 'attempt')
return {redis.call('GET', KEYS[1]), h[1], h[2]}
