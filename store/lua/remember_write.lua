-- Records a write id inside a MULTI/EXEC transaction (see _once.lua): after a lost EXEC reply,
-- redis-py raises WatchError instead of re-sending, and the caller looks for the id to learn whether
-- its transaction landed. Sent with EVAL (not EVALSHA): inside MULTI a missing script would fail
-- this one command while the others still apply.
-- KEYS[1] the hash holding the ids (a run's header)
-- ARGV[1] write id  ARGV[2] result to remember  ARGV[3] the field: writes or writes_others (_once.lua)
remember(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
return 1
