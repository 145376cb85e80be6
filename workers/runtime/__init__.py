"""The runtime of one turn: what an RQ job does between taking a run's lease and enqueuing its next turn.

``turn`` is the job function (``run_turn``) and the model call's path through save point A;
``settle`` reconciles and runs the tools through save point B; ``reconcile`` is the decision table,
``toolcall`` runs one tool, ``model`` is the only module importing ``anthropic``. ``takeover`` and
``reaper`` give a dead worker's turn to another, ``heartbeat`` keeps leases alive, ``jobs`` puts turns
on RQ's queue, ``settings`` reads the environment. Below it: ``agentpool.store`` (Redis) and the
definitions apps write (``agentpool.agent``, ``agentpool.tools``).
"""
