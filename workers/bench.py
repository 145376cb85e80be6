"""Placeholder: `agentpool bench` is being built."""

import click


@click.command()
def bench() -> None:
    """Not built yet."""
    raise click.ClickException("agentpool bench is not built yet")
