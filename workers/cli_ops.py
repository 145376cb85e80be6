"""Operator commands kept apart from the core CLI: each lives in its own module."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    """Attach the operator commands to the ``agentpool`` group (imported lazily by each command)."""
    from workers.bench import bench
    from workers.dashboard import dashboard
    from workers.demo import demo
    from workers.metrics import metrics

    for command in (bench, dashboard, demo, metrics):
        group.add_command(command)
