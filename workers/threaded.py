"""Placeholder: ``agentpool worker --concurrency N`` is being built."""

from typing import Any

import click


def run_threaded_worker(r: Any, **options: Any) -> None:
    raise click.ClickException("--concurrency > 1 is not built yet")
