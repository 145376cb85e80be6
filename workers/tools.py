"""``@tool``: a Python function the model may call, with its effect class and input schema.

The schema comes from the signature through pydantic, with parameter descriptions from the docstring
(docstring_parser, as the SDK's own tool helpers do). The model's input is validated against the same
pydantic model before the tool runs, and the full validation error goes back to the model so it can
correct itself. A keyword-only ``idempotency_key`` parameter is left out of the schema: the runner
passes a key that is stable for one tool_use across every retry and worker.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, get_type_hints

import docstring_parser
import pydantic

from agentpool.checks import optional_limit

Effect = Literal["read", "idempotent", "unsafe"]
EFFECTS: tuple[str, ...] = ("read", "idempotent", "unsafe")
IDEMPOTENCY_PARAM = "idempotency_key"

# What a verify hook returns: the tool's result text if the effect happened, False if it certainly
# did not (so it is safe to run now), None if it cannot tell.
VerifyResult = str | Literal[False] | None


class ToolInputError(ValueError):
    """The model's input does not match the tool's schema; the message is written for the model."""


@dataclass
class Tool:
    fn: Callable[..., Any]
    name: str
    description: str
    effect: Effect
    input_model: type[pydantic.BaseModel]
    input_schema: dict[str, Any]
    takes_key: bool
    timeout: float | None = None
    requires_approval: bool = False
    approval_timeout: float | None = None
    verify_fn: Callable[..., VerifyResult] | None = field(default=None, repr=False)
    # The function as written; ``fn`` is what the worker calls (for an ``async def`` tool, a function
    # that runs the coroutine to completion on an event loop of its own, in the tool's thread).
    function: Callable[..., Any] | None = field(default=None, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Still callable as the plain function (a coroutine function stays one), for the app's own code.
        return (self.function or self.fn)(*args, **kwargs)

    @property
    def parameters(self) -> list[str]:
        """The names of the input the model gives (every parameter but ``idempotency_key``)."""
        return list(self.input_model.model_fields)

    def verify(self, fn: Callable[..., VerifyResult]) -> Callable[..., VerifyResult]:
        """Decorator: ``@send_email.verify`` registers the hook reconcile asks when an unsafe call
        started and nobody recorded how it ended. It gets the call's arguments and ``idempotency_key``.
        Checked here: only an ``unsafe`` tool takes one, and it must accept those arguments."""
        self.verify_fn = _checked_verify(self, fn)
        return fn

    def to_param(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": self.input_schema}

    def validate(self, tool_input: Any) -> dict[str, Any]:
        """The tool's keyword arguments from the model's input, checked as the JSON Schema the model
        was given says: strictly, in pydantic's JSON mode, so "7" is no integer, "yes" no boolean and
        "nan" no number (lax mode would coerce each); NaN and infinities are refused outright."""
        if not isinstance(tool_input, dict):
            raise ToolInputError(f"input for {self.name} must be a JSON object, got {type(tool_input).__name__}")
        try:
            as_json = json.dumps(tool_input, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ToolInputError(f"invalid input for {self.name}: not JSON ({exc})") from None
        try:
            parsed = self.input_model.model_validate_json(as_json, strict=True)
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(input)'}: {err['msg']}" for err in exc.errors()
            )
            raise ToolInputError(f"invalid input for {self.name}: {problems}") from None
        return {name: getattr(parsed, name) for name in type(parsed).model_fields}


def _strip_titles(schema: Any) -> Any:
    # pydantic adds "title" everywhere; the model does not need it and it costs tokens on every call.
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title" or not isinstance(v, str)}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def _run_to_completion(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function running the coroutine function ``fn`` on an event loop of its own. The worker
    calls it in the tool's thread, under the tool's timeout, as it calls any tool."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        coroutine = fn(*args, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coroutine)
        # Called from inside a running loop (an async test, say): asyncio.run would refuse there.
        context = contextvars.copy_context()
        with ThreadPoolExecutor(1, thread_name_prefix="agentpool-async-tool") as pool:
            return pool.submit(context.run, asyncio.run, coroutine).result()

    return run


def _callable_form(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise TypeError(f"{what} is a generator function: a tool returns its result, it cannot yield it")
    return _run_to_completion(fn) if inspect.iscoroutinefunction(fn) else fn


def _checked_verify(tool: Tool, fn: Any) -> Callable[..., VerifyResult]:
    if tool.effect != "unsafe":
        kind = (
            "an idempotent tool is simply run again with the same idempotency_key"
            if tool.effect == "idempotent"
            else "a read tool is simply run again"
        )
        raise TypeError(
            f"tool {tool.name}: a verify hook is for unsafe tools; {kind} after a crash, so its hook would never be asked"
        )
    if not callable(fn):
        raise TypeError(f"tool {tool.name}: verify must be a function, got {type(fn).__name__}")
    name = getattr(fn, "__name__", "verify")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(tool.parameters), **{IDEMPOTENCY_PARAM: ""})
    except TypeError as exc:
        args = ", ".join(tool.parameters)
        raise TypeError(
            f"tool {tool.name}: its verify hook {name} is called with the tool's arguments ({args}) and a "
            f"keyword {IDEMPOTENCY_PARAM}, as in `def {name}({args + ', ' if args else ''}*, {IDEMPOTENCY_PARAM})`; "
            f"it cannot take them: {exc}"
        ) from None
    except ValueError:
        pass  # no signature to check (a builtin): trust it
    return _callable_form(fn, f"tool {tool.name}: verify hook {name}")


def _input_model(tool_name: str, fields: dict[str, Any]) -> tuple[type[pydantic.BaseModel], dict[str, Any]]:
    """The pydantic model of the tool's input and its JSON schema, or a TypeError naming the parameter
    whose type cannot be described to the model."""
    try:
        model = pydantic.create_model(  # type: ignore[call-overload]
            f"{tool_name}_input", __config__=pydantic.ConfigDict(extra="forbid", allow_inf_nan=False), **fields
        )
        return model, _strip_titles(model.model_json_schema())
    except pydantic.PydanticUserError as exc:
        for param, (hint, _field) in fields.items():
            try:
                pydantic.TypeAdapter(hint).json_schema()
            except pydantic.PydanticUserError:
                raise TypeError(
                    f"tool {tool_name}: parameter {param!r} has type {getattr(hint, '__name__', hint)!s}, which "
                    "cannot be described to the model as JSON Schema; take JSON-friendly input (str, int, float, "
                    "bool, list, dict, Literal, a TypedDict or a pydantic model) and build the object inside the tool"
                ) from None
        raise TypeError(f"tool {tool_name}: its input cannot be described to the model: {exc}") from None


def _build(
    fn: Callable[..., Any],
    *,
    name: str | None,
    effect: str,
    timeout: float | None,
    requires_approval: bool,
    approval_timeout: float | None,
    verify: Callable[..., VerifyResult] | None,
) -> Tool:
    if isinstance(fn, str):
        raise TypeError(f"@tool takes keyword arguments: write @tool(effect={fn!r}), not @tool({fn!r})")
    if isinstance(fn, Tool):
        raise TypeError(f"{fn.name} is already a tool: apply @tool once")
    if not callable(fn):
        raise TypeError(f"@tool decorates a function, got {type(fn).__name__}")
    if effect not in EFFECTS:
        raise ValueError(f"effect must be one of {', '.join(EFFECTS)}; got {effect!r}")
    label = getattr(fn, "__name__", repr(fn))
    runner = _callable_form(fn, f"tool {label}")
    timeout = optional_limit(f"tool {label}: timeout", timeout)
    approval_timeout = optional_limit(f"tool {label}: approval_timeout", approval_timeout)
    doc = docstring_parser.parse(inspect.getdoc(fn) or "")
    param_docs = {p.arg_name: p.description for p in doc.params}
    try:
        hints = get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - a forward reference that does not resolve, say
        raise TypeError(f"tool {label}: cannot read its type hints: {type(exc).__name__}: {exc}") from None
    fields: dict[str, Any] = {}
    takes_key = False
    for param in inspect.signature(fn).parameters.values():
        if param.name == IDEMPOTENCY_PARAM:
            takes_key = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described to the model")
        if param.name not in hints:
            raise TypeError(
                f"tool {label}: parameter {param.name!r} has no type annotation; annotate it ({param.name}: str, "
                "int, ...) so the model is told what to send and its input is checked"
            )
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (
            hints[param.name],
            pydantic.Field(default, description=param_docs.get(param.name)),
        )
    if effect == "read" and takes_key:
        raise TypeError(
            f"tool {label} is a read tool but takes {IDEMPOTENCY_PARAM!r}: a read has no effect to repeat "
            f"safely; drop the parameter, or declare effect='idempotent' if the call changes something"
        )
    if effect == "idempotent" and not takes_key:
        raise TypeError(
            f"tool {fn.__name__} is idempotent but takes no keyword-only {IDEMPOTENCY_PARAM!r}: "
            "without the key a retry is a second effect"
        )
    tool_name = name or label
    model, schema = _input_model(tool_name, fields)
    description = "\n\n".join(p for p in (doc.short_description, doc.long_description) if p) or tool_name
    built = Tool(
        fn=runner,
        name=tool_name,
        description=description,
        effect=effect,  # type: ignore[arg-type]
        input_model=model,
        input_schema=schema,
        takes_key=takes_key,
        timeout=timeout,
        requires_approval=requires_approval,
        approval_timeout=approval_timeout,
        function=fn,
    )
    if verify is not None:
        built.verify(verify)
    return built


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    effect: str = "unsafe",
    name: str | None = None,
    timeout: float | None = None,
    requires_approval: bool = False,
    approval_timeout: float | None = None,
    verify: Callable[..., VerifyResult] | None = None,
) -> Any:
    """Declare a tool. ``effect`` defaults to ``"unsafe"``: a tool nobody classified is never repeated.

    ``read``: no side effects, re-run freely. ``idempotent``: repeating with the same
    ``idempotency_key`` is safe. ``unsafe``: must not happen twice; give a ``verify`` hook if the
    effect can be looked up after a crash. ``requires_approval`` pauses the run for a person's
    decision before the call starts; ``approval_timeout`` (seconds) denies it automatically after that.

    An ``async def`` tool (or hook) runs to completion on an event loop of its own in the tool's
    thread, under the same timeout. Mistakes are refused here, not at the first call or crash: a
    parameter type JSON Schema cannot describe, a generator, a verify hook on a read or idempotent
    tool or one that cannot take the tool's arguments, a timeout that is not a finite positive number.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        return _build(
            f,
            name=name,
            effect=effect,
            timeout=timeout,
            requires_approval=requires_approval,
            approval_timeout=approval_timeout,
            verify=verify,
        )

    return wrap(fn) if fn is not None else wrap
