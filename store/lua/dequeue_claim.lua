-- Take the next job waiting on a worker's queues and, for a turn job, start it, in one round trip: what
-- RQ's BLMOVE and the claim's pipeline after it do in two (agentpool.worker.lean). Never blocks: a
-- worker sends it when its last dequeue left jobs waiting (a pool with a backlog, which is when Redis
-- is busiest), and waits with BLMOVE as before when it answers nothing.
-- A turn job (its id says so: "<run>-t<turn>[-r<n>]", agentpool.runtime.jobs.TURN_JOB_ID) goes from its
-- queue straight into the queue's started registry: one step, so it is never in neither, and it needs
-- no stay in RQ's intermediate queue, which only covers the gap between BLMOVE and the claim. Any other
-- job goes to the intermediate queue, as BLMOVE would put it, for RQ's own start.
-- KEYS per queue, in the worker's order: the queue, its intermediate queue, its started registry
-- (3 a queue); last, the worker's hash
-- ARGV[1] the execution id   ARGV[2] its entry's score in the started registry (the heartbeat deadline)
-- ARGV[3] the worker's state to write with a claim ('' when Redis has it already)
-- ARGV[4] the prefix of a job hash's key (rq:job:): the key is made of the id the pop found
-- ARGV[5] '1': the worker sent this take before and lost the reply, so a turn it took then is answered
-- again (found in a started registry by its score and execution id) before anything else is popped
-- Returns {} when every queue is empty, else {queue's position (1-based), job id, 1 if started or 0,
-- the job hash's field/value pairs...}: a job whose hash is gone is taken all the same (RQ skips it too)
-- and not started.
local last = #KEYS - 1
local function taken(at, id)
  return {(at + 2) / 3, id, 1, unpack(redis.call('HGETALL', ARGV[4] .. id))}
end
if ARGV[5] == '1' then
  local suffix = ':' .. ARGV[1]
  for at = 1, last, 3 do
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[at + 2], ARGV[2], ARGV[2])) do
      if string.sub(member, -#suffix) == suffix then return taken(at, string.sub(member, 1, -#suffix - 1)) end
    end
  end
end
for at = 1, last, 3 do
  local id = redis.call('LPOP', KEYS[at])
  if id then
    local job = redis.call('HGETALL', ARGV[4] .. id)
    local turn = string.match(id, '^.+%-t%d%d%d%d+$') or string.match(id, '^.+%-t%d%d%d%d+%-r%d+$')
    local started = 0
    if not turn then
      redis.call('RPUSH', KEYS[at + 1], id)
    elseif #job > 0 then
      redis.call('ZADD', KEYS[at + 2], ARGV[2], id .. ':' .. ARGV[1])
      if ARGV[3] ~= '' then redis.call('HSET', KEYS[#KEYS], 'state', ARGV[3]) end
      started = 1
    end
    return {(at + 2) / 3, id, started, unpack(job)}
  end
end
return {}
