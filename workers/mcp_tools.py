"""MCP servers as an agent's tools: ``Agent(mcp_servers={...})``, spelled as the Claude Agent SDK spells it.

This module is the definition side, with no connection in it: the servers' configuration (checked when
the agent is built), the effect class each tool gets from the protocol's annotations, and the ``Tool``
that stands for one MCP tool in the turn code, so settling, approvals and crash reconciliation treat it
exactly like an ``@tool`` function. The connections live in ``agentpool.runtime.mcp_hub``.

Effect classes (annotations are hints, so ``Agent(mcp_effects={...})`` overrides them per tool):
``readOnlyHint`` -> ``read``; ``idempotentHint`` without ``destructiveHint`` -> ``idempotent``; anything
else -> ``unsafe``. An idempotent tool whose input schema has an ``idempotency_key`` property gets the
run's stable key there (and the model never sees that property); one without it is idempotent as MCP
defines the hint: calling it again with the same arguments has no further effect, so after a crash it
is called again with exactly the arguments of the first attempt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pydantic

from agentpool.store.webhooks import bare_url
from agentpool.tools import EFFECTS, IDEMPOTENCY_PARAM, Effect, Tool, ToolInputError

PREFIX = "mcp__"
# What the Messages API takes as a tool name; a server's tool whose prefixed name does not fit is not offered.
API_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
SERVER_NAME = re.compile(r"^[a-zA-Z0-9-]+(_[a-zA-Z0-9-]+)*$")  # no "__": the name must split back apart
INSTALL_HINT = "MCP servers need the mcp extra: pip install 'agentpool[mcp]'"


class McpNotInstalled(ImportError):
    """``Agent(mcp_servers=...)`` without the ``mcp`` package."""


def require_mcp() -> None:
    """One line naming the extra, raised when the agent is built, not at its first turn."""
    try:
        import jsonschema  # noqa: F401 - comes with mcp
        import mcp  # noqa: F401
    except ImportError:
        raise McpNotInstalled(INSTALL_HINT) from None


def shown_url(url: str) -> str:
    """A server's URL for a repr or a log: no credentials, no query (a token often rides in either);
    ``***`` says that something was there."""
    try:
        parts = urlsplit(url)
        bare = bare_url(url)
    except ValueError:  # a port that is no number: nothing of it is shown
        return "***"
    userinfo = "***@" if "@" in parts.netloc else ""
    return bare.replace("://", f"://{userinfo}", 1) + ("?***" if parts.query else "")


def shown_spec(spec: Any) -> Any:
    """A server's config dict as a repr may show it: env and header values (tokens) and the URL's
    credentials and query hidden; the rest as given."""
    if not isinstance(spec, Mapping):
        return spec
    shown = dict(spec)
    for secret in ("env", "headers"):
        if isinstance(shown.get(secret), Mapping):
            shown[secret] = dict.fromkeys(shown[secret], "***")
    if isinstance(shown.get("url"), str):
        shown["url"] = shown_url(shown["url"])
    return shown


class ServerSpecs(dict):  # type: ignore[type-arg]
    """``Agent.mcp_servers`` as given, with a repr that shows no secret of theirs (``shown_spec``)."""

    def __repr__(self) -> str:
        return repr({name: shown_spec(spec) for name, spec in self.items()})


@dataclass(frozen=True)
class ServerConfig:
    """One server, as ``{"type": "stdio", "command", "args", "env"}`` or ``{"type": "http", "url", "headers"}``."""

    name: str
    type: str
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:  # env, headers and the URL may hold tokens: their values are never shown
        return f"ServerConfig(name={self.name!r}, {shown_spec(self.as_dict())!r})"

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for the worker's hub, across a process boundary)."""
        if self.type == "stdio":
            return {"type": "stdio", "command": self.command, "args": list(self.args), "env": dict(self.env)}
        return {"type": "http", "url": self.url, "headers": dict(self.headers)}

    @property
    def key(self) -> str:
        """One connection per distinct server per process: the name and everything that reaches the server."""
        return json.dumps([self.name, self.as_dict()], sort_keys=True)

    @classmethod
    def of(cls, name: str, spec: Mapping[str, Any]) -> ServerConfig:
        where = f"mcp_servers[{name!r}]"
        kind = spec.get("type", "stdio")  # the Agent SDK's default when only a command is given
        allowed = {"stdio": {"type", "command", "args", "env"}, "http": {"type", "url", "headers"}}
        if kind not in allowed:
            raise ValueError(f"{where}: type is 'stdio' or 'http', got {kind!r}")
        unknown = set(spec) - allowed[kind]
        if unknown:
            raise ValueError(f"{where}: unknown keys for a {kind} server: {', '.join(sorted(unknown))}")
        if kind == "stdio":
            command, args, env = spec.get("command"), spec.get("args", []), spec.get("env", {})
            if not isinstance(command, str) or not command:
                raise ValueError(f"{where}: a stdio server needs a command (a string)")
            if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
                raise ValueError(f"{where}: args is a list of strings")
            return cls(name, "stdio", command=command, args=tuple(args), env=_pairs(where, "env", env))
        url = spec.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: an http server needs a url starting with http:// or https://")
        return cls(name, "http", url=url, headers=_pairs(where, "headers", spec.get("headers", {})))


def _pairs(where: str, what: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{where}: {what} maps strings to strings")
    return tuple(sorted(value.items()))


def parse_servers(
    servers: Mapping[str, Any], effects: Mapping[str, str], approvals: Collection[str]
) -> dict[str, ServerConfig]:
    """The servers checked, and the per-tool overrides checked against them; ValueError naming what is wrong."""
    if not isinstance(servers, Mapping):
        raise TypeError("Agent(mcp_servers=...) maps a server name to its config dict")
    configs = {}
    for name, spec in servers.items():
        if not isinstance(name, str) or not SERVER_NAME.match(name):
            raise ValueError(
                f"mcp_servers: server name {name!r} must be letters, digits, '-' and single '_' "
                f"(tools are offered as {PREFIX}<server>__<tool>)"
            )
        if not isinstance(spec, Mapping):
            raise TypeError(f"mcp_servers[{name!r}] is a dict, got {type(spec).__name__}")
        configs[name] = ServerConfig.of(name, spec)
    for tool_name, effect in effects.items():
        _check_tool_name("mcp_effects", tool_name, configs)
        if effect not in EFFECTS:
            raise ValueError(f"mcp_effects[{tool_name!r}] must be one of {', '.join(EFFECTS)}, got {effect!r}")
    if isinstance(approvals, str):
        raise TypeError("mcp_requires_approval is a collection of tool names, not one string")
    for tool_name in approvals:
        _check_tool_name("mcp_requires_approval", tool_name, configs)
    return configs


def _check_tool_name(what: str, tool_name: Any, configs: Mapping[str, ServerConfig]) -> None:
    server = split_name(tool_name)[0] if isinstance(tool_name, str) else None
    if server not in configs:
        raise ValueError(
            f"{what}: {tool_name!r} names no tool of a configured server; write {PREFIX}<server>__<tool> "
            f"with a server of mcp_servers ({', '.join(configs) or 'none'})"
        )


def offered_name(server: str, tool: str) -> str:
    return f"{PREFIX}{server}__{tool}"


def split_name(name: str) -> tuple[str | None, str]:
    if not name.startswith(PREFIX) or "__" not in name[len(PREFIX) :]:
        return None, name
    server, _, tool = name[len(PREFIX) :].partition("__")
    return server, tool


def effect_from_annotations(annotations: Mapping[str, Any] | None) -> Effect:
    """The protocol's hints, by their wire names: readOnly -> read; idempotent and not destructive ->
    idempotent (destructiveHint defaults to true, so it must be false outright); otherwise unsafe."""
    hints = annotations or {}
    if hints.get("readOnlyHint") is True:
        return "read"
    if hints.get("idempotentHint") is True and hints.get("destructiveHint") is False:
        return "idempotent"
    return "unsafe"


class _NoModel(pydantic.BaseModel):
    """An MCP tool's input is checked against its JSON Schema, not a pydantic model; this stands in."""


@dataclass
class McpTool(Tool):
    """One MCP tool as the turn code sees it. ``fn`` calls the server through the worker's hub."""

    server: str = ""
    remote_name: str = ""  # the tool's own name on its server
    schema_check: Any = field(default=None, repr=False)  # a jsonschema validator of the schema the model gets
    properties: tuple[str, ...] = ()

    @property
    def parameters(self) -> list[str]:
        return list(self.properties)

    def validate(self, tool_input: Any) -> dict[str, Any]:
        """Checked strictly against the tool's inputSchema (as offered: without ``idempotency_key``),
        with every problem named for the model; NaN and infinities refused as for ``@tool`` functions. A
        schema that cannot be applied (a ``$ref`` to nothing) refuses every input, so the turn goes on."""
        if not isinstance(tool_input, dict):
            raise ToolInputError(f"input for {self.name} must be a JSON object, got {type(tool_input).__name__}")
        try:
            plain = json.loads(json.dumps(tool_input, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ToolInputError(f"invalid input for {self.name}: not JSON ({exc})") from None
        try:
            errors = sorted(self.schema_check.iter_errors(plain), key=lambda e: list(e.absolute_path))
        except Exception as exc:  # noqa: BLE001 - a schema jsonschema cannot apply: a $ref to nothing, a bad pattern
            raise ToolInputError(
                f"{self.name} cannot be called: its server's inputSchema cannot be checked "
                f"({type(exc).__name__}: {str(exc)[:300]})"
            ) from None
        if errors:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e.absolute_path) or '(input)'}: {e.message}" for e in errors
            )
            raise ToolInputError(f"invalid input for {self.name}: {problems}")
        return plain  # type: ignore[no-any-return]


def build_tool(
    server: str,
    listed: Mapping[str, Any],
    *,
    effects: Mapping[str, str],
    approvals: Collection[str],
    timeout: float,
    caller: Callable[..., Any],
) -> McpTool | None:
    """The ``Tool`` for one entry of a server's tools/list (wire names: name, description, inputSchema,
    annotations), or None if it cannot be offered (a name the API refuses, a schema that is no schema).
    ``caller(arguments)`` calls it on its server."""
    import jsonschema

    name = offered_name(server, str(listed.get("name", "")))
    schema = listed.get("inputSchema")
    if not API_TOOL_NAME.match(name) or not isinstance(schema, dict) or schema.get("type") != "object":
        return None
    properties = dict(schema.get("properties") or {})
    takes_key = IDEMPOTENCY_PARAM in properties
    if takes_key:  # the run's key goes there, never the model's
        properties.pop(IDEMPOTENCY_PARAM)
        required = [r for r in schema.get("required", []) if r != IDEMPOTENCY_PARAM]
        schema = {**schema, "properties": properties, "required": required}
        if not required:
            schema.pop("required")
    try:
        validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator_class.check_schema(schema)
    except jsonschema.SchemaError:
        return None
    effect = effects.get(name) or effect_from_annotations(listed.get("annotations"))

    def call_server(**arguments: Any) -> str:
        return caller(arguments)  # type: ignore[no-any-return]

    call_server.__name__ = name
    return McpTool(
        fn=call_server,
        name=name,
        description=str(listed.get("description") or listed.get("title") or name),
        effect=effect,  # type: ignore[arg-type]
        input_model=_NoModel,
        input_schema=schema,
        takes_key=takes_key,
        timeout=timeout,
        requires_approval=name in approvals,
        server=server,
        remote_name=str(listed["name"]),
        schema_check=validator_class(schema),
        properties=tuple(properties),
    )
