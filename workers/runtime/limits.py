"""The limits a run is held to between turns: the agent's, overridden per run, raised by ``resume``.

A run stopped by a limit, or completed, records the limits it was held to in its ``status`` event
(``limit_fields``), so that ``resume`` can tell, without importing the agent, whether what it adds lets
another turn start, and refuse with what is needed when it does not (``needed_to_resume``); and so that
a message to a run completed at a limit is refused instead of starting a turn that would stop at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentpool.pricing import price_of
from agentpool.store.records import RunState

if TYPE_CHECKING:
    from agentpool.agent import Agent  # only a type here: `resume` and the CLI need no agent's code

# The limit, and the amount ``resume`` adds to it.
RAISED_BY = {"max_turns": "add_turns", "max_total_tokens": "add_tokens", "max_cost_usd": "add_usd"}
EXTRAS = {"max_turns": "extra_turns", "max_total_tokens": "extra_tokens", "max_cost_usd": "extra_usd"}


def _finite(value: Any) -> Any:
    """A number stored in a run's record, or None: NaN or infinity (a record written before every way of
    setting a limit was checked) must not switch a budget off, so it counts as not set."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_total_tokens: int | None
    max_cost_usd: float | None

    @classmethod
    def of(cls, agent: Agent, run_limits: Mapping[str, Any]) -> Limits:
        def pick(name: str) -> Any:
            base = _finite(run_limits.get(name))
            base = getattr(agent, name) if base is None else base
            return None if base is None else base + (_finite(run_limits.get(EXTRAS[name])) or 0)

        return cls(pick("max_turns"), pick("max_total_tokens"), pick("max_cost_usd"))

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> Limits | None:
        """The limits a stopped run's ``status`` event recorded (see ``limit_fields``); None if it has none."""
        if "max_turns" not in fields:
            return None
        tokens, cost = fields.get("max_total_tokens"), fields.get("max_cost_usd")
        return cls(int(fields["max_turns"]), int(tokens) if tokens else None, float(cost) if cost else None)

    def limit_fields(self) -> dict[str, Any]:
        """For the ``status`` event of a run this stopped: what ``from_fields`` reads back."""
        return {
            "max_turns": self.max_turns,
            "max_total_tokens": self.max_total_tokens,
            "max_cost_usd": None if self.max_cost_usd is None else repr(float(self.max_cost_usd)),
        }

    def raised(self, adds: Mapping[str, int | float]) -> Limits:
        """These limits with ``resume``'s amounts (``add_turns``, ``add_tokens``, ``add_usd``) added; a
        limit that is not set stays not set, as in ``of``."""

        def up(value: Any, amount: float) -> Any:
            return None if value is None else value + amount

        return Limits(
            self.max_turns + int(adds.get("add_turns", 0)),
            up(self.max_total_tokens, int(adds.get("add_tokens", 0))),
            up(self.max_cost_usd, float(adds.get("add_usd", 0.0))),
        )

    def exhausted(self, state: RunState) -> dict[str, str]:
        """Each limit the run has used up, with what it used, in words."""
        out = {}
        if state.turns >= self.max_turns:
            out["max_turns"] = f"{state.turns} of max_turns={self.max_turns}"
        tokens = sum(state.usage.values())
        if self.max_total_tokens is not None and tokens >= self.max_total_tokens:
            out["max_total_tokens"] = f"{tokens} of max_total_tokens={self.max_total_tokens} tokens"
        if self.max_cost_usd is not None and state.cost_usd >= self.max_cost_usd:
            out["max_cost_usd"] = f"${state.cost_usd:.6f} of max_cost_usd={self.max_cost_usd:g}"
        return out

    def reached(self, agent: Agent, state: RunState) -> str | None:
        """Why the run must stop before another model call, in words a user can act on; None to go on."""
        used = self.exhausted(state)
        if "max_turns" in used:
            return f"reached max_turns={self.max_turns} after {state.turns} turns; resume with more turns to continue"
        if "max_total_tokens" in used:
            return (
                f"reached max_total_tokens={self.max_total_tokens} ({sum(state.usage.values())} tokens used); "
                "resume with more tokens to continue"
            )
        if self.max_cost_usd is not None and price_of(agent.model) is None:
            return (
                f"max_cost_usd is set but no price is known for model {agent.model!r}; add one with "
                "agentpool.pricing.set_price in a module every worker imports (the one defining the agent)"
            )
        if "max_cost_usd" in used:
            return (
                f"reached max_cost_usd={self.max_cost_usd:g} (${state.cost_usd:.4f} spent); "
                "resume with more budget to continue"
            )
        return None

    def needed_to_resume(self, state: RunState) -> dict[str, int | float]:
        """The least each ``resume`` amount must be for another turn to start (empty: nothing is
        needed). Money is rounded up to the micro-dollar, so the figure itself is enough."""
        needs: dict[str, int | float] = {}
        if state.turns >= self.max_turns:
            needs["add_turns"] = state.turns - self.max_turns + 1
        tokens = sum(state.usage.values())
        if self.max_total_tokens is not None and tokens >= self.max_total_tokens:
            needs["add_tokens"] = tokens - self.max_total_tokens + 1
        if self.max_cost_usd is not None and state.cost_usd >= self.max_cost_usd:
            over = state.cost_usd - self.max_cost_usd
            needs["add_usd"] = math.floor(over * 1e6 + 1) / 1e6  # strictly more than spent over the limit
        return needs

    def short_of(self, state: RunState, adds: Mapping[str, int | float]) -> str | None:
        """None if ``adds`` (``add_turns``, ``add_tokens``, ``add_usd``) let another turn start; otherwise
        what is missing: "the run has used 2 of max_turns=2; resume with add_turns>=1" (a clause a limit)."""
        used, needs = self.exhausted(state), self.needed_to_resume(state)
        parts = [
            f"the run has used {used[limit]}; resume with {amount}>={needs[amount]:{'.6f' if amount == 'add_usd' else 'd'}}"
            for limit, amount in RAISED_BY.items()
            if amount in needs and adds.get(amount, 0) < needs[amount]
        ]
        return "; ".join(parts) or None
