-- Drop a lease whose token matches exactly, or (for a work horse known to be dead) ends with ARGV[2].
-- The run stays in the watch set, due at ARGV[4], so the reaper makes sure it has a live job.
-- KEYS[1] lease   KEYS[2] ap:runs:watch
-- ARGV[1] exact token or ''   ARGV[2] token suffix or ''   ARGV[3] run id   ARGV[4] due ms
-- Returns 1 released, 0 the lease was not ours (or already gone).
local holder = redis.call('GET', KEYS[1])
if not holder then return 0 end
local ours = (ARGV[1] ~= '' and holder == ARGV[1])
  or (ARGV[2] ~= '' and string.sub(holder, -string.len(ARGV[2])) == ARGV[2])
if not ours then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
return 1
