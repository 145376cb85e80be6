-- A child run's end that no other script makes (a cancel, in the same MULTI as its status change):
-- tells its parent (see _join.lua).
-- KEYS[1] the child's header  KEYS[2] ap:runs:watch  KEYS[3..5] the parent's header, joins hash, events
-- ARGV[1] child run id  ARGV[2] parent run id  ARGV[3] now ms
-- Returns 2 if the parent was woken, 1 if only marked, 0 if it had been told already.
return join_parent(KEYS[1], 3, KEYS[2], ARGV[1], ARGV[2], ARGV[3])
