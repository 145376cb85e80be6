"""The limits a run is held to between turns: the agent's, overridden per run, raised by ``resume``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentpool.agent import Agent
from agentpool.pricing import price_of
from agentpool.store.records import RunState


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_total_tokens: int | None
    max_cost_usd: float | None

    @classmethod
    def of(cls, agent: Agent, run_limits: Mapping[str, Any]) -> Limits:
        def pick(name: str, extra: str) -> Any:
            base = run_limits.get(name)
            base = getattr(agent, name) if base is None else base
            return None if base is None else base + run_limits.get(extra, 0)

        return cls(
            pick("max_turns", "extra_turns"),
            pick("max_total_tokens", "extra_tokens"),
            pick("max_cost_usd", "extra_usd"),
        )

    def reached(self, agent: Agent, state: RunState) -> str | None:
        """Why the run must stop before another model call, in words a user can act on; None to go on."""
        if state.turns >= self.max_turns:
            return f"reached max_turns={self.max_turns} after {state.turns} turns; resume with more turns to continue"
        tokens = sum(state.usage.values())
        if self.max_total_tokens is not None and tokens >= self.max_total_tokens:
            return (
                f"reached max_total_tokens={self.max_total_tokens} ({tokens} tokens used); "
                "resume with more tokens to continue"
            )
        if self.max_cost_usd is not None:
            if price_of(agent.model) is None:
                return (
                    f"max_cost_usd is set but no price is known for model {agent.model!r}; "
                    "add one with agentpool.pricing.set_price"
                )
            if state.cost_usd >= self.max_cost_usd:
                return (
                    f"reached max_cost_usd={self.max_cost_usd:g} (${state.cost_usd:.4f} spent); "
                    "resume with more budget to continue"
                )
        return None
