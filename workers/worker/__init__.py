"""The processes that run turns: RQ's forking worker (``forking``), the threaded worker (``threaded``)
and the supervisor above it (``supervisor``). Each runs the reaper and hands a dead turn holder's turns
over at once."""
