"""Everything that talks to Redis for runs: key names, codec, records, lease, save points, ledger, events.

This package imports neither `rq` nor `anthropic`; `workers` builds on it.
"""
