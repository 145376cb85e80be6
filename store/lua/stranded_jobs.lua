-- The reaper's look at RQ's intermediate lists (a job a worker moved there with BLMOVE and then never
-- claimed: killed in between, or its reply swallowed by a silent connection). Records in Redis when each
-- job listed there was first seen, on Redis's clock, so a sighting outlives the process that made it: the
-- reaper's lock moving to another worker does not start the wait again, and `agentpool reap --once` run
-- twice gives the job back. A job no longer listed is forgotten.
-- KEYS[1] ap:stranded   KEYS[2..] the intermediate lists (rq:queue:<name>:intermediate)
-- ARGV[1] ms a job must have been listed for   ARGV[2] how many of each list to look at
-- Returns {i, job id, ms listed, ...} for each job listed at least ARGV[1] ms, i its list's index in KEYS.
local clock = redis.call('TIME')
local now = clock[1] * 1000 + math.floor(clock[2] / 1000)
local seen = {}
local flat = redis.call('HGETALL', KEYS[1])
for j = 1, #flat, 2 do seen[flat[j]] = flat[j + 1] end
local listed, due = {}, {}
for i = 2, #KEYS do
  for _, job in ipairs(redis.call('LRANGE', KEYS[i], 0, ARGV[2] - 1)) do
    listed[job] = true
    local since = seen[job]
    if since == nil then
      redis.call('HSET', KEYS[1], job, now)
    elseif now - since >= ARGV[1] + 0 then
      due[#due + 1] = i - 1
      due[#due + 1] = job
      due[#due + 1] = now - since
    end
  end
end
for job in pairs(seen) do
  if not listed[job] then redis.call('HDEL', KEYS[1], job) end
end
return due
