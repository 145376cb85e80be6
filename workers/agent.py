"""``Agent``: what a run executes. Named by an import path ``module:attribute`` that workers import
(``agentpool.runtime.loader``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentpool.checks import limit_value, optional_limit
from agentpool.tools import Tool


@dataclass
class Agent:
    model: str
    system: str = ""
    tools: list[Tool] = field(default_factory=list)
    max_turns: int = 40
    max_tokens: int = 1024
    max_total_tokens: int | None = 2_000_000  # input + output + cache tokens of every call paid for
    max_cost_usd: float | None = None  # needs a price for the model (agentpool.pricing)
    approval_timeout: float | None = None  # seconds before an unanswered approval is denied
    tool_timeout: float = 120.0  # seconds; a tool's own ``timeout`` wins
    max_result_chars: int = 100_000  # a longer tool result is cut, with a note to the model
    model_options: dict[str, Any] = field(default_factory=dict)  # extra messages.create arguments

    def __post_init__(self) -> None:
        if isinstance(self.tools, Tool) or not isinstance(self.tools, (list, tuple)):
            raise TypeError(f"Agent(tools=...) takes a list of @tool functions, got {type(self.tools).__name__}")
        for t in self.tools:
            if not isinstance(t, Tool):  # before anything reads .name
                what = getattr(t, "__name__", None) or repr(t)
                raise TypeError(
                    f"Agent(tools=...): {what} is not a tool; decorate it with @tool(effect=...) "
                    "(read, idempotent or unsafe) so the model gets its schema and a crash is reconciled safely"
                )
        self.tools = list(self.tools)
        names = [t.name for t in self.tools]
        duplicates = {n for n in names if names.count(n) > 1}
        if duplicates:
            raise ValueError(f"duplicate tool names: {', '.join(sorted(duplicates))}")
        self.max_turns = limit_value("max_turns", self.max_turns, whole=True)
        self.max_tokens = limit_value("max_tokens", self.max_tokens, whole=True)
        self.max_total_tokens = optional_limit("max_total_tokens", self.max_total_tokens, whole=True)
        self.max_cost_usd = optional_limit("max_cost_usd", self.max_cost_usd)
        self.approval_timeout = optional_limit("approval_timeout", self.approval_timeout)
        self.tool_timeout = limit_value("tool_timeout", self.tool_timeout)
        self.max_result_chars = limit_value("max_result_chars", self.max_result_chars, whole=True)
        self._by_name = {t.name: t for t in self.tools}

    def tool_named(self, name: str) -> Tool | None:
        return self._by_name.get(name)


def check_agent_path(path: str) -> None:
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"an agent is named 'module:attribute', got {path!r}")
