"""``@tool``: a Python function the model may call, with its effect class and input schema.

The schema comes from the signature through pydantic, with parameter descriptions from the docstring
(docstring_parser, as the SDK's own tool helpers do). The model's input is validated against the same
pydantic model before the tool runs, and the full validation error goes back to the model so it can
correct itself. A keyword-only ``idempotency_key`` parameter is left out of the schema: the runner
passes a key that is stable for one tool_use across every retry and worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_type_hints

import docstring_parser
import pydantic

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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Still callable as the plain function, for the app's own code and tests.
        return self.fn(*args, **kwargs)

    def verify(self, fn: Callable[..., VerifyResult]) -> Callable[..., VerifyResult]:
        """Decorator: ``@send_email.verify`` registers the hook reconcile asks when an unsafe call
        started and nobody recorded how it ended. It gets the call's arguments and ``idempotency_key``."""
        self.verify_fn = fn
        return fn

    def to_param(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": self.input_schema}

    def validate(self, tool_input: Any) -> dict[str, Any]:
        if not isinstance(tool_input, dict):
            raise ToolInputError(f"input for {self.name} must be a JSON object, got {type(tool_input).__name__}")
        try:
            parsed = self.input_model.model_validate(tool_input)
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
    if effect not in EFFECTS:
        raise ValueError(f"effect must be one of {', '.join(EFFECTS)}; got {effect!r}")
    doc = docstring_parser.parse(inspect.getdoc(fn) or "")
    param_docs = {p.arg_name: p.description for p in doc.params}
    hints = get_type_hints(fn)
    fields: dict[str, Any] = {}
    takes_key = False
    for param in inspect.signature(fn).parameters.values():
        if param.name == IDEMPOTENCY_PARAM:
            takes_key = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described to the model")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (
            hints.get(param.name, Any),
            pydantic.Field(default, description=param_docs.get(param.name)),
        )
    if effect == "idempotent" and not takes_key:
        raise TypeError(
            f"tool {fn.__name__} is idempotent but takes no keyword-only {IDEMPOTENCY_PARAM!r}: "
            "without the key a retry is a second effect"
        )
    tool_name = name or fn.__name__
    model = pydantic.create_model(  # type: ignore[call-overload]
        f"{tool_name}_input", __config__=pydantic.ConfigDict(extra="forbid"), **fields
    )
    description = "\n\n".join(p for p in (doc.short_description, doc.long_description) if p) or tool_name
    return Tool(
        fn=fn,
        name=tool_name,
        description=description,
        effect=effect,  # type: ignore[arg-type]
        input_model=model,
        input_schema=_strip_titles(model.model_json_schema()),
        takes_key=takes_key,
        timeout=timeout,
        requires_approval=requires_approval,
        approval_timeout=approval_timeout,
        verify_fn=verify,
    )


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
