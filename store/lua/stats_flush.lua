-- Adds a process's accumulated counters to the pool-wide stats hash, once per flush id: a flush whose
-- reply was lost is re-sent with the same id and adds nothing the second time (see store/stats.py).
-- KEYS[1] ap:stats   KEYS[2] ap:stats:flush:<id> (a marker that expires after a minute)
-- ARGV[1..] counter, amount, counter, amount...
-- Returns 1 added, 0 already added by an earlier delivery of the same flush.
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', 60000) then return 0 end
for i = 1, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
