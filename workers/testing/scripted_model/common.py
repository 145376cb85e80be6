"""What the scripted model's parts share: the API's error shape, ids, token estimates, thinking signatures."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import string
from typing import Any

# Signatures only need to be unforgeable by the client and stable within one server process.
_SIGNING_SECRET = secrets.token_bytes(32)


_BASE62 = string.ascii_letters + string.digits


ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class ApiError(Exception):
    """An error answered in the API's error shape."""

    def __init__(
        self, status: int, err_type: str, message: str, headers: dict[str, str] | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.message = message
        self.headers = headers or {}
        self.code = code  # the API's `error.details.error_code`, for the errors that name their cause


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message)


def random_id(prefix: str, length: int = 24) -> str:
    return prefix + "".join(secrets.choice(_BASE62) for _ in range(length))


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def sign_thinking(thinking: str) -> str:
    """Signature of a thinking block; only this process can make one that verifies."""
    digest = hmac.new(_SIGNING_SECRET, thinking.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def unoffered_tool_use_id(name: str) -> str:
    """The id of a tool_use the scripted model wrote for a tool its request did not offer (a script
    playing a model's mistake). It carries a signature over the name, so a later request may send the
    block back although its ``tools`` lack that name; a client cannot make one (a tool_use it names after
    a tool it dropped from ``tools`` is still refused). Shaped like any id: ``toolu_`` and 24 letters and
    digits."""
    base = random_id("toolu_", 12)
    return base + _unoffered_mac(base, name)


def is_unoffered_tool_use(tool_use_id: str, name: str) -> bool:
    """Whether ``tool_use_id`` was made by :func:`unoffered_tool_use_id` for ``name`` in this process."""
    base, mac = tool_use_id[:-12], tool_use_id[-12:]
    return len(tool_use_id) > 12 and hmac.compare_digest(mac, _unoffered_mac(base, name))


def _unoffered_mac(base: str, name: str) -> str:
    return hmac.new(_SIGNING_SECRET, f"unoffered\0{base}\0{name}".encode(), hashlib.sha256).hexdigest()[:12]


def parse_json(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"There was an error parsing the body: {exc}") from None


def error_body(err: ApiError, request_id: str) -> dict:
    error: dict[str, Any] = {"type": err.err_type, "message": err.message}
    if err.code:
        error["details"] = {"error_code": err.code}
    return {"type": "error", "error": error, "request_id": request_id}


def sign_opaque(purpose: str, data: str) -> str:
    """A signature over ``data`` for ``purpose`` (compaction blocks): only this process can make one."""
    digest = hmac.new(_SIGNING_SECRET, f"{purpose}\0{data}".encode(), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def digest(value: Any) -> str:
    return hashlib.sha256(canonical(value).encode("utf-8")).hexdigest()
