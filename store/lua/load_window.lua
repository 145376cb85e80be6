-- The messages a turn sends: from the latest compaction point the header knows of (its `window`, an
-- index into the message list; 0 for a run never compacted) to the end. The caller trims a compaction
-- block it finds further on (the hint may lag one turn behind one: see agentpool.store.window).
-- KEYS[1] run header   KEYS[2] messages
-- Returns {start index, blobs from it}.
local start = tonumber(redis.call('HGET', KEYS[1], 'window') or '0') or 0
return {start, redis.call('LRANGE', KEYS[2], start, -1)}
