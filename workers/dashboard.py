"""Placeholder: `agentpool dashboard` is being built."""

import click


@click.command()
def dashboard() -> None:
    """Not built yet."""
    raise click.ClickException("agentpool dashboard is not built yet")
