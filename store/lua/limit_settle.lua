-- Settle a reservation once its call is over: what it did not use goes back to the buckets (or what
-- it used beyond the estimate is taken), and the limits and remaining budget the API's headers
-- reported are learned. Once per reservation id: a re-sent call finds it settled and changes nothing.
-- The headers come first, then the correction: the API's remaining was counted before this call's
-- own correction too (it holds max_tokens until the reply ends, as the reservation did).
-- KEYS[1] budget hash  KEYS[2] held hash  KEYS[3] set of models with a budget
-- ARGV[1] requests to give back (1: the call was reserved but never made)  ARGV[2] minute ms
-- ARGV[3] reservation id ('' for headers alone)
-- ARGV[4..5] input, output tokens to give back (negative: taken)
-- ARGV[6..8] operator limits rpm, itpm, otpm (0: none)
-- ARGV[9..11] learned limits requests, input, output (0: not reported)
-- ARGV[12..14] remaining requests, input, output as reported (-1: not reported)  ARGV[15] model
-- ARGV[16..18] for a call made while nothing limited the model: the requests and tokens started unlimited
-- as its reservation counted them (limit_reserve); -1 otherwise. The remaining its headers report was
-- counted when the API admitted it, and no bucket here took the calls started unlimited, so two kinds
-- come off that remaining (the first calls of a pool that has not learned its limits yet would
-- otherwise be followed by calls the API refuses):
--   the calls started after it: the API had not counted them yet;
--   the calls started before it and still in flight (their entries in the held hash): the API admits
--   calls in its own order, and may count them after this one. One it had counted already comes off
--   twice, which only holds back what the buckets refill; missed, it would be a 429.
-- An entry of a call started unlimited counts for a minute (ARGV[2]) after it started: its worker may
-- have died, and by then the API has admitted it if it ever will, and refilled as much. Older ones are
-- deleted here, and once the last call started unlimited ('started:at') is a minute old, the next
-- settle deletes whatever is left of them and that field.
-- ARGV[19] how old a reservation made within limits must be to be dropped as dead (ms)  ARGV[20] how often
-- the held hash is looked through for those (ms; the budget's 'swept' says when it last was)
-- Returns 1 settled (its entry in the held hash removed), 0 nothing held under that id (headers still
-- learned).
-- Redis's clock, not the caller's: every worker's refill is measured on one clock.
local t = redis.call('TIME')
-- The arguments are numbers as the worker wrote them: arithmetic converts each once (tonumber, twice).
local now, minute = t[1] * 1000 + math.floor(t[2] / 1000), ARGV[2] + 0
local settled = 0
if ARGV[3] ~= '' and redis.call('HDEL', KEYS[2], ARGV[3]) == 1 then settled = 1 end
local back = {ARGV[1] + 0, ARGV[4] + 0, ARGV[5] + 0}
if settled == 0 then back = {0, 0, 0} end
local b, b_learned, b_level, b_started = read_budget(KEYS[1])
local LEARNED, LEVEL = budget_fields()
local started_at = {ARGV[16] + 0, ARGV[17] + 0, ARGV[18] + 0}
-- What the calls started unlimited before this one and still in flight need.
local before = {0, 0, 0}
local sweep = b.started_at and now - b.started_at >= minute
if started_at[1] >= 0 or sweep then
  local held = redis.call('HGETALL', KEYS[2])
  for i = 1, #held, 2 do
    local in_, out, ms, req, seq = string.match(held[i + 1], '^(%S+) (%S+) (%S+) (%S+) (%S+) %S+ %S+$')
    if not seq then
      -- a reservation made within limits: its budget was taken already
    elseif now - tonumber(ms) >= minute then
      redis.call('HDEL', KEYS[2], held[i])
    elseif tonumber(seq) < started_at[1] then
      before[1], before[2], before[3] = before[1] + tonumber(req), before[2] + tonumber(in_), before[3] + tonumber(out)
    end
  end
  if sweep then redis.call('HDEL', KEYS[1], 'started:at') end
end
local at = (b.at or now) + 0
local fields = {'at', now}
-- A reservation made within limits whose worker died never settles either: every ARGV[20] ms, the ones
-- older than ARGV[19] ms (far longer than a call stays in flight) leave the held hash. Their budget
-- refilled long ago; left there, they would count as calls in flight (`agentpool limits`) for ever.
if now - (b.swept or 0) >= ARGV[20] + 0 then
  local held = redis.call('HGETALL', KEYS[2])
  for i = 1, #held, 2 do
    local ms = tonumber(string.match(held[i + 1], '^%S+ %S+ (%S+)$'))
    if ms and now - ms >= tonumber(ARGV[19]) then redis.call('HDEL', KEYS[2], held[i]) end
  end
  table.insert(fields, 'swept'); table.insert(fields, now)
end
-- The model is listed among those with a budget when a limit is learned that the budget did not hold
-- (the reply of every call reports them again; one SADD a call would be one command a turn for nothing).
local learned_new = false
for i = 1, 3 do
  local learned = ARGV[8 + i] + 0
  if learned > 0 then
    -- Written only when it changed: every reply reports the same limits again.
    if tonumber(b_learned[i]) ~= learned then
      learned_new = true
      table.insert(fields, LEARNED[i]); table.insert(fields, ARGV[8 + i])
    end
  else
    learned = (b_learned[i] or 0) + 0
  end
  local l = limit_in_force(ARGV[5 + i] + 0, learned)
  if l > 0 then
    local lv = refilled(b_level[i], l, at, now, minute)
    local remaining = ARGV[11 + i] + 0
    if remaining >= 0 then
      if started_at[i] >= 0 then
        remaining = remaining - ((b_started[i] or 0) - started_at[i]) - before[i]
      end
      lv = math.min(lv, remaining)
    end
    lv = math.min(l, lv + back[i])
    table.insert(fields, LEVEL[i]); table.insert(fields, lv)
  end
end
redis.call('HSET', KEYS[1], unpack(fields))
if learned_new then redis.call('SADD', KEYS[3], ARGV[15]) end
return settled
