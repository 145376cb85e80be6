-- Prepended to the scripts that reserve a model call's budget (limit_reserve; lease_acquire, which
-- reserves the turn's call with its lease: see store/scripts.py).
-- reserve_budget(budget, held, waiting, needs, models, a, now): the keys, the arguments `a` laid out as
-- limit_reserve's ARGV, and Redis's clock in ms when the caller read it already (nil: read here).
-- `held` is not written: the calls in flight are the budget's 'held:<reservation id>' fields (the held
-- hash of earlier versions, still passed, is only swept: limit_settle).
local function reserve_budget(budget, held, waiting, needs, models, a, now)
  -- The arguments are numbers as the worker wrote them: arithmetic converts each once (tonumber, twice).
  local need = {a[6] + 0, a[7] + 0, a[8] + 0}
  local b, b_learned, b_level, b_started, mine = read_budget(budget, {a[5]})
  local _, LEVEL, STARTED = budget_fields()
  local limit = {}
  for i = 1, 3 do
    limit[i] = limit_in_force(a[8 + i] + 0, (b_learned[i] or 0) + 0)
  end
  -- Nothing limits the model and nothing will be learned: the common case of a model without limits
  -- costs this script's one read.
  local unlimited = limit[1] == 0 and limit[2] == 0 and limit[3] == 0
  if unlimited and b.headerless and not b.pause then return {3, 0} end
  -- Redis's clock, not the caller's: every worker's refill is measured on one clock.
  if not now then
    local t = redis.call('TIME')
    now = t[1] * 1000 + math.floor(t[2] / 1000)
  end
  local minute = a[2] + 0
  -- A re-sent call finds the entry its first delivery left in the budget (read above) and answers as the
  -- first did; a call that waited left none.
  if mine[1] then
    local r, i_, o = string.match(mine[1], '^%S+ %S+ %S+ %S+ (%S+) (%S+) (%S+)$')
    if r then return {3, 0, tonumber(r), tonumber(i_), tonumber(o)} end
    return {2, 0}
  end
  -- A 429 that taught nothing (no rate-limit headers: a gateway's) paused the model's calls until its
  -- retry-after (limit_pause.lua): every call waits that out, not only the one that met it. No ticket:
  -- the line is the budget's, and nothing is taken.
  if b.pause then
    local paused = tonumber(b.pause) - now
    if paused > 0 then return {4, paused} end
    redis.call('HDEL', budget, 'pause')  -- over: the next calls read the budget as before it
    if unlimited and b.headerless then return {3, 0} end
  end
  local started, counted = {3, 0}, {'started:at', now}
  local entry = a[7] .. ' ' .. a[8] .. ' ' .. now
  if unlimited then
    for i = 1, 3 do
      local n = (b_started[i] or 0) + need[i]
      table.insert(started, n)
      table.insert(counted, STARTED[i]); table.insert(counted, n)
    end
    entry = entry .. ' ' .. need[1] .. ' ' .. started[3] .. ' ' .. started[4] .. ' ' .. started[5]
  end
  -- The call is in flight until it settles: its entry ('held:<reservation id>') is written with the
  -- budget's own fields, in the one write a granted call makes.
  local held_field = 'held:' .. a[5]
  -- Nothing limits the model yet, but the first replies may teach limits: count what the call starts
  -- and hold it as in flight (no budget taken) until it settles.
  if unlimited then
    table.insert(counted, held_field); table.insert(counted, entry)
    redis.call('HSET', budget, unpack(as_hashtable(b, counted)))
    return started
  end
  local at = (b.at or now) + 0
  local level = {}
  for i = 1, 3 do
    if limit[i] > 0 then level[i] = refilled(b_level[i], limit[i], at, now, minute) end
  end
  -- Listed among the models with a budget when its budget is first written here (settle lists it again
  -- when it learns a limit it did not know).
  if not b.at then redis.call('SADD', models, a[3]) end
  -- What the live tickets ahead of this one need (expired ones leave the line as they are read). The
  -- budget's 'line' says whether anybody may be in line: '0' once a call found it empty, so the usual
  -- call reads no line at all. The line is read from its head only as far as it decides the answer:
  -- once the tickets read (with this call; at least SAMPLE live ones) ask more than the budget holds,
  -- this call waits whatever the rest need, and its wait is counted from what every ticket in line
  -- needs together (the budget's 'line:sum', kept by each call that joins or leaves the line) if it
  -- is new to the line, else estimated from those read, scaled to how many are ahead of it (a ticket
  -- that waited once comes back when those ahead should be through, near the head, where it reads
  -- them all). A call is granted only once every ticket ahead of it was read and the budget covers
  -- them all, so nobody overtakes a live ticket; a long line costs a call a few reads, not one per
  -- ticket in it.
  local ahead = {0, 0, 0}
  local SAMPLE = 8  -- live tickets read at least (if so many are ahead): what the estimate averages
  local function outrun()
    for i = 1, 3 do
      if limit[i] > 0 and level[i] < ahead[i] + math.min(need[i], limit[i]) then return true end
    end
    return false
  end
  local in_line = false  -- whether this call's ticket holds a place already (it waited before)
  local behind = 0  -- live tickets left in line once this call is through (only needed if granted)
  local sum = {0, 0, 0}  -- what the tickets in line need together
  local own = {0, 0, 0}  -- what this call's ticket needs as the line holds it (if it holds a place)
  if b.line ~= '0' then
    local rank = redis.call('ZRANK', waiting, a[4])
    local count = redis.call('ZCARD', waiting)
    in_line = rank ~= false
    -- (A line an earlier release began has no sum: its newcomers estimate, as a ticket in line does.)
    local summed = count == 0
    if count > 0 then
      local kept = numbers_of(b.line_sum, 3)
      if kept then sum, summed = kept, true end
    end
    local upto = in_line and rank or count  -- tickets ahead of this one, expired ones included
    local live = 0
    local read = walk_line(waiting, upto, function(m)
      local rec = numbers_of(redis.call('HGET', needs, m), 4)
      if not rec or rec[4] < now then
        redis.call('ZREM', waiting, m)
        redis.call('HDEL', needs, m)
        if rec then sum[1], sum[2], sum[3] = sum[1] - rec[1], sum[2] - rec[2], sum[3] - rec[3] end
        return true
      end
      ahead[1], ahead[2], ahead[3] = ahead[1] + rec[1], ahead[2] + rec[2], ahead[3] + rec[3]
      live = live + 1
    end, function() return live < SAMPLE or not outrun() end)
    local unread = upto - read
    if unread > 0 and not in_line and summed then  -- every ticket in line is ahead of a newcomer
      for i = 1, 3 do ahead[i] = math.max(ahead[i], sum[i]) end
    elseif unread > 0 and live > 0 then  -- the wait's estimate: the unread ahead as those read, on average
      for i = 1, 3 do ahead[i] = ahead[i] * (live + unread) / live end
    end
    behind = live + unread + (in_line and count - rank - 1 or 0)
    if in_line then
      local rec = numbers_of(redis.call('HGET', needs, a[4]), 4)
      if rec then own = {rec[1], rec[2], rec[3]} end
    end
  end
  -- The line's sum once this call waits (its need in, in place of what its ticket held) or is granted
  -- (its ticket's need out; nothing left once nobody is behind it).
  local function line_sum(fields, joining)
    local out = {}
    for i = 1, 3 do out[i] = math.max(0, sum[i] - own[i] + (joining and need[i] or 0)) end
    if not joining and behind == 0 then out = {0, 0, 0} end
    table.insert(fields, 'line:sum'); table.insert(fields, sum_text(out))
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
    for i = 1, 3 do
      if limit[i] > 0 then table.insert(fields, LEVEL[i]); table.insert(fields, level[i]) end
    end
    table.insert(fields, 'line'); table.insert(fields, 1)
    line_sum(fields, true)
    redis.call('HSET', budget, unpack(as_hashtable(b, fields)))  -- not granted: nothing held
    redis.call('ZADD', waiting, 'NX', now, a[4])
    redis.call('HSET', needs, a[4],
      need[1] .. ' ' .. need[2] .. ' ' .. need[3] .. ' ' .. (now + wait + tonumber(a[12])))
    return {0, wait}
  end
  for i = 1, 3 do
    if limit[i] > 0 then table.insert(fields, LEVEL[i]); table.insert(fields, level[i] - need[i]) end
  end
  if b.line ~= '0' and behind == 0 then table.insert(fields, 'line'); table.insert(fields, 0) end
  if b.line ~= '0' then line_sum(fields, false) end
  table.insert(fields, held_field); table.insert(fields, entry)
  redis.call('HSET', budget, unpack(as_hashtable(b, fields)))
  if in_line then
    redis.call('ZREM', waiting, a[4])
    redis.call('HDEL', needs, a[4])
  end
  -- Room to spare: nobody in line, and every limited bucket at least half full once this call is
  -- taken. Its settle may then wait a second to go with others (agentpool.store.ratelimit).
  local roomy = 1
  if ahead[1] + ahead[2] + ahead[3] > 0 or behind > 0 then roomy = 0 end
  for i = 1, 3 do
    if limit[i] > 0 and (level[i] - need[i]) * 2 < limit[i] then roomy = 0 end
  end
  return {1, 0, roomy}
end
