"""``python -m agentpool`` is the ``agentpool`` command."""

from agentpool.ops.cli import main

main()
