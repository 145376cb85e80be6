"""USD per million tokens, per model, for ``max_cost_usd`` budgets and the cost figures.

The table is a starting point, not a bill: check it against your price list and extend or correct it
with ``set_price`` (for example in the module that defines your agents, which every worker imports).
Models are matched by exact id first, then by the longest prefix in the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Price:
    input: float
    output: float
    cache_read: float  # usually 0.1x input
    cache_write: float  # usually 1.25x input (5-minute cache)

    def cost(self, usage: Mapping[str, int]) -> float:
        return (
            usage.get("input_tokens", 0) * self.input
            + usage.get("output_tokens", 0) * self.output
            + usage.get("cache_read_input_tokens", 0) * self.cache_read
            + usage.get("cache_creation_input_tokens", 0) * self.cache_write
        ) / 1_000_000


def _family(input_usd: float, output_usd: float) -> Price:
    return Price(input_usd, output_usd, round(input_usd * 0.1, 4), round(input_usd * 1.25, 4))


PRICES: dict[str, Price] = {
    "claude-opus-4-5": _family(5, 25),
    "claude-opus-4": _family(15, 75),
    "claude-opus": _family(5, 25),
    "claude-sonnet": _family(3, 15),
    "claude-haiku-4": _family(1, 5),
    "claude-haiku": _family(1, 5),
}


def set_price(
    model: str, *, input: float, output: float, cache_read: float | None = None, cache_write: float | None = None
) -> None:
    """Add or correct a model's price (USD per million tokens); a prefix such as ``claude-sonnet`` works too."""
    PRICES[model] = Price(
        input,
        output,
        input * 0.1 if cache_read is None else cache_read,
        input * 1.25 if cache_write is None else cache_write,
    )


def price_of(model: str) -> Price | None:
    if model in PRICES:
        return PRICES[model]
    matches = [prefix for prefix in PRICES if model.startswith(prefix)]
    return PRICES[max(matches, key=len)] if matches else None
