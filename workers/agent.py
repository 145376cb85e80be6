"""``Agent``: what a run executes. Named by an import path ``module:attribute`` that workers import
(``agentpool.runtime.loader``)."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from agentpool.checks import limit_value, optional_limit
from agentpool.mcp_tools import PREFIX, McpTool, ServerConfig, ServerSpecs, parse_servers, require_mcp
from agentpool.store.keys import check_concurrency_key, check_queue
from agentpool.tools import Tool

# The models that take the API's server-side compaction (the `compact_20260112` edit): the docs name
# Opus 4.6 and 4.7, Sonnet 4.6 and later models. Others get agentpool's summary call instead.
SERVER_COMPACTION_MODELS = (
    "claude-opus-4-6",
    "claude-opus-4-7",
    "claude-opus-4-8",
    "claude-sonnet-4-6",
    "claude-opus-5",
    "claude-sonnet-5",
    "claude-haiku-5",
    "claude-fable-5",
    "claude-mythos-5",
)
SERVER_MIN_TRIGGER = 50_000  # the API refuses a lower trigger for its compaction edit

# The summary call of agentpool's own compaction (models without the API's) ends its request with this.
SUMMARY_PROMPT = (
    "Context compaction: this conversation is about to outgrow the context window, so it will continue from "
    "a summary of it instead of the messages so far. Write that summary now. Include: the original task and "
    "every instruction, constraint or preference given; what has been done, naming each tool call that "
    "changed something outside this conversation and its result, so that it is not repeated; what was "
    "learned (facts, figures, names, identifiers) that the rest of the task needs; the decisions made and "
    "why; and what remains to do, in order. Write only the summary, and call no tool."
)
# What the saved summary starts with: the message the next request starts from.
SUMMARY_PREAMBLE = (
    "This conversation continues from an earlier part that was compacted to fit the context window. "
    "A summary of that part follows.\n\n"
)


@dataclass(frozen=True)
class Compaction:
    """How a run continues past the model's context window: ``Agent(compaction=Compaction(...))``
    (``compaction=True`` takes these defaults).

    With a model that supports it (``server_side=None`` decides by model), the API compacts: requests
    carry the ``compact_20260112`` edit, and a request whose input passes ``trigger`` tokens is answered
    after a summary of the conversation, which later requests start from. Otherwise agentpool does it:
    once a request would pass ``trigger``, the model is asked for a summary in a call of its own
    (counted in usage and budgets), which becomes the message the next request starts from.
    """

    trigger: int = 150_000  # input tokens of a request that start a compaction
    instructions: str | None = None  # extra guidance for the summary
    pause_after_compaction: bool = False  # API compaction: a turn ends at the summary; the next one goes on
    server_side: bool | None = None  # None: the API's compaction where the model supports it
    # The API's tool-result clearing edit, passed through as given (True: the API's defaults), e.g.
    # {"trigger": {"type": "input_tokens", "value": 100_000}, "keep": {"type": "tool_uses", "value": 3}}.
    clear_tool_uses: dict[str, Any] | bool | None = None
    summary_max_tokens: int = 4096  # agentpool's summary call: max_tokens

    def __post_init__(self) -> None:
        if not isinstance(self.trigger, int) or isinstance(self.trigger, bool) or self.trigger < 1:
            raise ValueError(f"Compaction.trigger must be a positive number of input tokens, got {self.trigger!r}")
        if self.summary_max_tokens < 1 or self.summary_max_tokens >= self.trigger:
            raise ValueError(
                "Compaction.summary_max_tokens must be positive and below the trigger "
                f"({self.summary_max_tokens} >= {self.trigger}): a summary must fit well within it"
            )
        if not isinstance(self.clear_tool_uses, (dict, bool, type(None))):
            raise TypeError(
                "Compaction.clear_tool_uses is the clear_tool_uses_20250919 edit's settings (a dict) or True"
            )

    def uses_server(self, model: str) -> bool:
        return self.server_side if self.server_side is not None else model.startswith(SERVER_COMPACTION_MODELS)


TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # what the Messages API accepts as a tool's name
DEFAULT_MAX_DEPTH = 10  # an agent delegating to itself stops within this many levels
DEFAULT_MAX_FANOUT = 10  # sub-agent calls one response may start


@dataclass(frozen=True)
class Subagent:
    """A sub-agent an agent may delegate to: ``Agent(subagents={"researcher": Subagent("myapp.agents:researcher",
    description="Finds sources")})`` (a bare ``"module:attribute"`` string takes the defaults).

    The model gets a tool of that name whose input is ``{"task": "..."}``; each call starts a child run
    of the agent at ``path`` with that task, and its final text becomes the call's tool_result.
    ``queue`` and ``concurrency_key`` name where the child runs (None: as its parent does, on its
    parent's queue, under its parent's key and limit); a key of its own is limited by
    ``max_concurrency`` or by an operator's ``agentpool limits set KEY N``."""

    path: str
    description: str | None = None
    queue: str | None = None
    concurrency_key: str | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        check_agent_path(self.path)
        value = self.description
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"Subagent.description is a non-empty string or None, got {value!r}")
        if self.queue is not None:
            check_queue(self.queue)
        if self.concurrency_key is not None:
            check_concurrency_key(self.concurrency_key)
        if self.max_concurrency is not None:
            if self.concurrency_key is None:
                raise ValueError("Subagent.max_concurrency needs a concurrency_key: the runs it limits together")
            object.__setattr__(
                self, "max_concurrency", limit_value("max_concurrency", self.max_concurrency, whole=True)
            )

    def to_param(self, name: str) -> dict[str, Any]:
        """The tool the model is offered for this sub-agent."""
        return {
            "name": name,
            "description": self.description
            or (
                f"Delegate a task to the {name} sub-agent. It works on it on its own, with its own tools, "
                "and answers with its final text. Several calls in one response run in parallel."
            ),
            "input_schema": {
                "type": "object",
                "properties": {
                    "task": {
                        "type": "string",
                        "description": "The task, complete in itself: the sub-agent sees nothing else.",
                    }
                },
                "required": ["task"],
            },
        }


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
    # Past the context window: None/False (off: a run that outgrows it stops), True, or Compaction(...).
    compaction: Compaction | bool | None = None
    # MCP servers whose tools the model gets beside ``tools``, as mcp__<server>__<tool> (agentpool.mcp_tools):
    # {"name": {"type": "stdio", "command": ..., "args": [...], "env": {...}}} or {"type": "http", "url": ...}.
    mcp_servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    mcp_effects: dict[str, str] = field(default_factory=dict)  # per tool, over what its annotations say
    mcp_requires_approval: Collection[str] = ()  # tools whose calls wait for a person's decision
    # Sub-agents offered to the model as tools: tool name -> "module:attribute" or Subagent(...).
    subagents: dict[str, Subagent | str] = field(default_factory=dict)
    max_depth: int = DEFAULT_MAX_DEPTH  # how deep a tree of sub-agents may go below a top-level run
    max_fanout: int = DEFAULT_MAX_FANOUT  # sub-agent calls one response may start (the rest get an error)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(
                f"Agent(model=...) names the Claude model to call, e.g. 'claude-sonnet-5-5'; got {self.model!r}"
            )
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
        self.subagents = _subagents(self.subagents)
        names = [t.name for t in self.tools] + list(self.subagents)
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
        self.max_depth = limit_value("max_depth", self.max_depth, whole=True)
        self.max_fanout = limit_value("max_fanout", self.max_fanout, whole=True)
        if self.compaction is True:
            self.compaction = Compaction()
        elif self.compaction is False:
            self.compaction = None
        elif self.compaction is not None and not isinstance(self.compaction, Compaction):
            raise TypeError(f"compaction is True, False, None or a Compaction, got {self.compaction!r}")
        if self.compaction and self.compaction.uses_server(self.model) and self.compaction.trigger < SERVER_MIN_TRIGGER:
            raise ValueError(
                f"the API's compaction needs a trigger of at least {SERVER_MIN_TRIGGER:,} input tokens "
                f"(got {self.compaction.trigger:,}); raise it, or use agentpool's own with Compaction(server_side=False)"
            )
        self._by_name = {t.name: t for t in self.tools}
        self.mcp_configs: dict[str, ServerConfig] = {}
        if self.mcp_servers:
            require_mcp()
            self.mcp_configs = parse_servers(self.mcp_servers, self.mcp_effects, self.mcp_requires_approval)
            self.mcp_servers = ServerSpecs(self.mcp_servers)  # the same dict, with a repr that hides its tokens
            clash = [t.name for t in self.tools if t.name.startswith(PREFIX)]
            if clash:
                raise ValueError(f"tool names starting with {PREFIX} are for MCP servers' tools: {', '.join(clash)}")
        elif self.mcp_effects or self.mcp_requires_approval:
            raise ValueError("mcp_effects and mcp_requires_approval name tools of mcp_servers, and there are none")
        self.mcp_requires_approval = frozenset(self.mcp_requires_approval)
        # The servers' tools as this process last listed them (agentpool.runtime.mcp_hub.attach), swapped
        # whole so a turn running in another thread reads either the old set or the new one.
        self._mcp: tuple[list[McpTool], dict[str, McpTool], dict[str, Any]] = ([], {}, {})

    def tool_named(self, name: str) -> Tool | None:
        return self._by_name.get(name) or self._mcp[1].get(name)

    @property
    def offered_tools(self) -> list[Tool]:
        """What the model is offered: the agent's own tools, then its MCP servers' tools."""
        return [*self.tools, *self._mcp[0]]

    @property
    def mcp_tools(self) -> list[McpTool]:
        return list(self._mcp[0])

    @property
    def mcp_listings(self) -> dict[str, Any]:
        return self._mcp[2]

    def use_mcp_tools(self, tools: list[McpTool], listings: dict[str, Any]) -> None:
        self._mcp = (list(tools), {t.name: t for t in tools}, listings)

    def subagent_named(self, name: str) -> Subagent | None:
        found = self.subagents.get(name)
        return found if isinstance(found, Subagent) else None

    def tool_params(self) -> list[dict[str, Any]]:
        """Every tool the model is offered: the agent's tools, its MCP servers' tools, then its sub-agents."""
        return [t.to_param() for t in self.offered_tools] + [
            s.to_param(name) for name, s in self.subagents.items() if isinstance(s, Subagent)
        ]

    @property
    def compaction_mode(self) -> str | None:
        """``"server"`` (the API compacts), ``"summary"`` (agentpool asks for a summary) or None (off)."""
        if not isinstance(self.compaction, Compaction):
            return None
        return "server" if self.compaction.uses_server(self.model) else "summary"


def _subagents(given: Any) -> dict[str, Subagent | str]:
    if not isinstance(given, dict):
        raise TypeError(f"Agent(subagents=...) maps tool names to agent paths, got {type(given).__name__}")
    out: dict[str, Subagent | str] = {}
    for name, value in given.items():
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError(f"sub-agent name {name!r}: a tool name is 1 to 64 letters, digits, '_' or '-'")
        if isinstance(value, str):
            value = Subagent(value)
        if not isinstance(value, Subagent):
            raise TypeError(f"sub-agent {name!r}: give a 'module:attribute' path or Subagent(...), got {value!r}")
        out[name] = value
    return out


def check_agent_path(path: object) -> None:
    if isinstance(path, Agent):
        raise TypeError(
            "a run names its agent by import path, as a string ('myapp.agents:support': module:attribute), "
            "so that any worker can load it; got the Agent itself"
        )
    if not isinstance(path, str):
        raise TypeError(f"an agent is named by its import path 'module:attribute' (a str), got {type(path).__name__}")
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"an agent is named 'module:attribute', got {path!r}")
