"""Operator commands (metrics, dashboard), kept apart from the core CLI."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    """Attach the operator commands to the ``agentpool`` group."""
