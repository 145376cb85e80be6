-- A run's end that no other script makes (a cancel, in the same MULTI as its status change): records its
-- webhook delivery (see _webhook.lua).
-- KEYS[1] run header  KEYS[2] the run's deliveries hash  KEYS[3] ap:webhooks:due
-- ARGV[1] run id  ARGV[2] status  ARGV[3] now ms  ARGV[4] the events the pool default wants (or 'maybe')
-- Returns the delivery's number, or 0 if none was recorded.
local w = take_webhook()
return record_webhook(w, KEYS[1], ARGV[1], ARGV[2], ARGV[3])
