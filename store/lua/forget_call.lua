-- Drop the note of a model call billed to the run (store/spend.py, note_call) if it is still that
-- call's: once the call is counted (a cut stream's spend, or a save point A refused after counting it),
-- a takeover must not count it again; a note another attempt wrote since stays.
-- KEYS[1] the note (ap:{run:<id>}:call)  ARGV[1] the API's id for the call
-- Returns 1 if dropped, 0 otherwise.
local note = redis.call('GET', KEYS[1])
if note and string.sub(note, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then return redis.call('DEL', KEYS[1]) end
return 0
