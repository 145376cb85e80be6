-- Drops from ap:runs the ids whose run header is gone (it expired after the run's retention), so the
-- index holds the runs that exist instead of every run ever made. The check and the drop are one
-- step: a run is never dropped while its header exists.
-- KEYS[1] ap:runs   KEYS[2..] run headers   ARGV[i] the run id whose header is KEYS[i + 1]
-- Returns how many ids were dropped.
local dropped = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    dropped = dropped + redis.call('ZREM', KEYS[1], ARGV[i - 1])
  end
end
return dropped
