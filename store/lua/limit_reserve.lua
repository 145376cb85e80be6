-- Reserve one model call's budget in the pool's rate limits for a model, or give it a place in line.
-- The budget is three token buckets (requests, input tokens, output tokens per minute) refilled
-- continuously, as the API's are; a limit is the lower of the one an operator set (ARGV) and the one
-- learned from the API's headers (the budget hash); a dimension with neither is not limited.
-- Waiting calls hold tickets in a sorted set scored by when they began to wait: a call is granted only
-- if the budget covers it after what every live ticket ahead of it needs, so waiting turns go in the
-- order they started waiting however their retries interleave. A ticket lives until ARGV[10] past its
-- expected wait; a turn that never comes back (cancelled, its run gone) stops holding its place then.
-- Idempotent per reservation id: a re-sent call (redis-py retry) finds its entry in the held hash and
-- takes nothing, counts nothing, and answers as the first did.
-- KEYS[1] budget hash  KEYS[2] held hash (reservation id -> "in out ms", or for a call started while
-- unlimited "in out ms requests r i o")  KEYS[3] waiting zset
-- KEYS[4] needs hash (ticket -> "requests in out expires_ms")  KEYS[5] set of models with a budget
-- The budget hash's 'line' is 1 once a ticket joined the line and '0' once a call found it empty, so a
-- call reads the line only when somebody may be in it (no field: look, as a budget written before it).
-- ARGV[1] unused  ARGV[2] minute ms  ARGV[3] model  ARGV[4] ticket  ARGV[5] reservation id
-- ARGV[6..8] needed requests, input tokens, output tokens  ARGV[9..11] operator limits rpm, itpm, otpm
-- (0: none)  ARGV[12] ticket slack ms
-- Returns {1, 0} granted, {0, wait_ms} wait (the ticket is in line), {2, 0} already granted,
-- {3, 0, r, i, o} nothing limits this model yet (no limit set or learned): no budget is taken. r, i, o
-- are the requests and tokens started while unlimited, this call's included (the budget's 'started:'
-- counters; 'started:at' is when the last such call started). The call stays in the held hash, with
-- its need and those counters, until it settles: when a reply's headers teach the limits,
-- limit_settle takes off the remaining they report what was started after that call and what the
-- calls started before it and still in flight need (the API may admit those after it).
-- {3, 0} alone once a reply came back with no rate-limit headers at all (field 'headerless': a gateway,
-- a scripted model without limits): nothing will be learned, so nothing is counted or held, and this
-- script costs its one read.
local dims = {'requests', 'input', 'output'}
local need = {tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])}
local state = redis.call('HGETALL', KEYS[1])
local h = {}
for i = 1, #state, 2 do h[state[i]] = state[i + 1] end
local limit = {}
for i, d in ipairs(dims) do
  local set, learned = tonumber(ARGV[8 + i]), tonumber(h['learned:' .. d] or 0)
  if set > 0 and learned > 0 then limit[i] = math.min(set, learned) elseif set > 0 then limit[i] = set else limit[i] = learned end
end
-- Nothing limits the model and nothing will be learned: the common case of a model without limits
-- costs this script's one read.
local unlimited = limit[1] == 0 and limit[2] == 0 and limit[3] == 0
if unlimited and h['headerless'] then return {3, 0} end
-- Redis's clock, not the caller's: every worker's refill is measured on one clock.
local t = redis.call('TIME')
local now, minute = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(ARGV[2])
-- The call's entry in the held hash, taken first: a re-sent call finds it there and answers as the first
-- did (one HSETNX where a look and a write would be two; a call that waits gives it back below).
local started, counted = {3, 0}, {'started:at', now}
local entry = need[2] .. ' ' .. need[3] .. ' ' .. now
if unlimited then
  for i, d in ipairs(dims) do
    local n = tonumber(h['started:' .. d] or 0) + need[i]
    table.insert(started, n)
    table.insert(counted, 'started:' .. d); table.insert(counted, n)
  end
  entry = entry .. ' ' .. need[1] .. ' ' .. started[3] .. ' ' .. started[4] .. ' ' .. started[5]
end
if redis.call('HSETNX', KEYS[2], ARGV[5], entry) == 0 then
  local mine = redis.call('HGET', KEYS[2], ARGV[5])
  local r, i_, o = string.match(mine or '', '^%S+ %S+ %S+ %S+ (%S+) (%S+) (%S+)$')
  if r then return {3, 0, tonumber(r), tonumber(i_), tonumber(o)} end
  return {2, 0}
end
-- Nothing limits the model yet, but the first replies may teach limits: count what the call starts
-- and hold it as in flight (no budget taken) until it settles.
if unlimited then
  redis.call('HSET', KEYS[1], unpack(counted))
  return started
end
local at = tonumber(h['at'] or now)
local level = {}
for i, d in ipairs(dims) do
  local l = limit[i]
  if l > 0 then
    local lv = tonumber(h['level:' .. d] or l)
    level[i] = math.min(l, lv + math.max(0, now - at) * l / minute)
  end
end
-- Listed among the models with a budget when its budget is first written here (settle lists it again
-- when it learns a limit it did not know).
if not h['at'] then redis.call('SADD', KEYS[5], ARGV[3]) end
-- What the live tickets ahead of this one need (expired ones leave the line). The budget's 'line' says
-- whether anybody may be in line: '0' once a call found it empty, so the usual call reads no line at all.
local ahead = {0, 0, 0}
local in_line = false  -- whether this call's ticket holds a place already (it waited before)
local behind = 0  -- live tickets left in line once this call is through
if h['line'] ~= '0' then
  local members = redis.call('ZRANGE', KEYS[3], 0, -1)
  for n, m in ipairs(members) do
    if m == ARGV[4] then
      in_line = true
      behind = behind + #members - n
      break
    end
    local rec = redis.call('HGET', KEYS[4], m)
    local r, i_, o, exp = string.match(rec or '', '^(%S+) (%S+) (%S+) (%S+)$')
    if not exp or tonumber(exp) < now then
      redis.call('ZREM', KEYS[3], m)
      redis.call('HDEL', KEYS[4], m)
    else
      ahead[1], ahead[2], ahead[3] = ahead[1] + tonumber(r), ahead[2] + tonumber(i_), ahead[3] + tonumber(o)
      behind = behind + 1
    end
  end
end
local wait = 0
for i = 1, 3 do
  if limit[i] > 0 then
    local want = ahead[i] + math.min(need[i], limit[i])
    if level[i] < want then
      wait = math.max(wait, math.ceil((want - level[i]) * minute / limit[i]))
    end
  end
end
local fields = {'at', now}
if wait > 0 then
  for i, d in ipairs(dims) do
    if limit[i] > 0 then table.insert(fields, 'level:' .. d); table.insert(fields, level[i]) end
  end
  table.insert(fields, 'line'); table.insert(fields, 1)
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('HDEL', KEYS[2], ARGV[5])  -- not granted: nothing held
  redis.call('ZADD', KEYS[3], 'NX', now, ARGV[4])
  redis.call('HSET', KEYS[4], ARGV[4],
    need[1] .. ' ' .. need[2] .. ' ' .. need[3] .. ' ' .. (now + wait + tonumber(ARGV[12])))
  return {0, wait}
end
for i, d in ipairs(dims) do
  if limit[i] > 0 then table.insert(fields, 'level:' .. d); table.insert(fields, level[i] - need[i]) end
end
if h['line'] ~= '0' and behind == 0 then table.insert(fields, 'line'); table.insert(fields, 0) end
redis.call('HSET', KEYS[1], unpack(fields))
if in_line then
  redis.call('ZREM', KEYS[3], ARGV[4])
  redis.call('HDEL', KEYS[4], ARGV[4])
end
return {1, 0}
