-- Prepended to the scripts that report their write as a progress event (see store/scripts.py).
-- record_event(stream, stats, at) reads the event from ARGV[at..], as store.events.Event.script_args
-- lays it out: the stream's cap, a count n and n field/value pairs, a count m and m counter/amount
-- pairs (no ARGV[at] at all: no event). It appends the event to the run's stream and adds the counters to the pool-wide stats hash,
-- inside the script that makes the write: the event exists exactly when the write does.
local function record_event(stream, stats, at)
  if ARGV[at] == nil then return end  -- the caller passed no event
  local n = tonumber(ARGV[at + 1])
  local fields = {}
  for i = at + 2, at + 1 + 2 * n do fields[#fields + 1] = ARGV[i] end
  redis.call('XADD', stream, 'MAXLEN', '~', ARGV[at], '*', unpack(fields))
  local m_at = at + 2 + 2 * n
  for i = m_at + 1, m_at + 2 * tonumber(ARGV[m_at]), 2 do
    redis.call('HINCRBYFLOAT', stats, ARGV[i], ARGV[i + 1])
  end
end
