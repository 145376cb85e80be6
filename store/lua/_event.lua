-- Prepended to the scripts that report their write as a progress event (see store/scripts.py).
-- record_event(stream, stats, at) reads an event from ARGV[at..], as agentpool.store.events.script_args lays
-- it out: the stream's cap, a count n and n field/value pairs, a count m and m counter/amount pairs;
-- a cap of 0 (or no ARGV[at] at all) stands for no event. It appends the event to the run's stream
-- and adds the counters to the pool-wide stats hash, inside the script that makes the write: the
-- event exists exactly when the write does. Returns the index of the ARGV after the event.
-- The counts are integers as the caller wrote them: arithmetic converts each once (tonumber would
-- convert twice, and these are a turn's most frequent conversions).
local function record_event(stream, stats, at)
  local cap = ARGV[at]
  if not cap or cap == '' then return at end
  if cap == '0' then return at + 1 end
  local m_at = at + 2 + 2 * ARGV[at + 1]
  redis.call('XADD', stream, 'MAXLEN', '~', cap, '*', unpack(ARGV, at + 2, m_at - 1))
  local after = m_at + 1 + 2 * ARGV[m_at]
  for i = m_at + 1, after - 1, 2 do
    redis.call('HINCRBYFLOAT', stats, ARGV[i], ARGV[i + 1])
  end
  return after
end
