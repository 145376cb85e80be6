"""Placeholder: `agentpool metrics` is being built."""

import click


@click.command()
def metrics() -> None:
    """Not built yet."""
    raise click.ClickException("agentpool metrics is not built yet")


def start_metrics_server(port: int, r: object) -> None:
    raise click.ClickException("--metrics-port is not built yet")
