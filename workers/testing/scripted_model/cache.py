"""Token estimates and prompt caching, as the API counts them: a prefix up to a cache breakpoint is
written once and read while it lives (5 min, or 1 h with ttl "1h"); shorter prefixes are not cached.

An image counts as the API counts it, by its pixels (width × height / 750, scaled down to 1,568 pixels
on its long edge and about 1,600 tokens), not by the length of its base64 data: a PNG's size is read
from its header; any other image counts as the most one costs. A PDF counts by its pages, as a page
of prose costs (``PDF_PAGE_TOKENS``: its text and an image of it)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import struct
import time
from typing import Any

from agentpool.runtime.documents import pdf_block_data, pdf_pages
from agentpool.testing.scripted_model.common import canonical, estimate_tokens

CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}
IMAGE_MAX_EDGE = 1568
IMAGE_MAX_TOKENS = 1600
PIXELS_PER_TOKEN = 750
PDF_PAGE_TOKENS = 2_400


def image_tokens(block: dict[str, Any]) -> int:
    """What an image block costs the API's model (the vision guide's formula)."""
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    size = _png_size(source.get("data")) if source.get("type") == "base64" else None
    if size is None:
        return IMAGE_MAX_TOKENS
    width, height = size
    scale = min(1.0, IMAGE_MAX_EDGE / max(width, height))
    scale = min(scale, math.sqrt(IMAGE_MAX_TOKENS * PIXELS_PER_TOKEN / (width * height)))
    return max(1, math.ceil(width * height * scale * scale / PIXELS_PER_TOKEN))


def _png_size(data: Any) -> tuple[int, int] | None:
    if not isinstance(data, str):
        return None
    try:
        head = base64.b64decode(data[:32])
    except (binascii.Error, ValueError):
        return None
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", head[16:24])
    return (width, height) if width and height else None


def pdf_block_pages(block: Any) -> int | None:
    """The pages of a PDF ``document`` block as this model counts them (one for a PDF whose pages it
    cannot see); None for any other block."""
    data = pdf_block_data(block)
    return None if data is None else pdf_pages(data) or 1


def _stand_in(block: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Text of ``tokens`` tokens standing for ``block``, keyed by its data."""
    key = hashlib.sha256(canonical(block).encode()).hexdigest()
    return {"type": block["type"], "counted_as": key + "." * max(0, 4 * tokens - 96)}


def _counted(block: Any) -> Any:
    """The block as its tokens are counted: an image (also inside a tool_result) stands as text of its
    cost in tokens, keyed by its data so that a prefix holding it is cached as itself."""
    if not isinstance(block, dict):
        return block
    if block.get("type") == "image":
        return _stand_in(block, image_tokens(block))
    if (pages := pdf_block_pages(block)) is not None:
        return _stand_in(block, pages * PDF_PAGE_TOKENS)
    if block.get("type") == "tool_result" and isinstance(block.get("content"), list):
        return {**block, "content": [_counted(sub) for sub in block["content"]]}
    return block


def strip_cache_control(block: Any) -> tuple[Any, str | None]:
    """Block without cache_control (also inside tool_result content) and the marker's TTL, if any."""
    if not isinstance(block, dict):
        return block, None
    ttl = None
    stripped = {k: v for k, v in block.items() if k != "cache_control"}
    if block.get("cache_control"):
        ttl = block["cache_control"].get("ttl", "5m")
    if block.get("type") == "tool_result" and isinstance(block.get("content"), list):
        inner = []
        for sub in block["content"]:
            sub_stripped, sub_ttl = strip_cache_control(sub)
            inner.append(sub_stripped)
            ttl = ttl or sub_ttl
        stripped["content"] = inner
    return stripped, ttl


def cache_units(body: dict) -> tuple[list, list[tuple[int, str]]]:
    """The prompt as an ordered list of units (tools, system, message blocks) without cache_control,
    and the (unit index, ttl) of every cache breakpoint, in the API's prefix order."""
    units: list = []
    markers: list[tuple[int, str]] = []

    def add(unit: Any, ttl: str | None) -> None:
        units.append(unit)
        if ttl:
            markers.append((len(units) - 1, ttl))

    for tool in body.get("tools") or []:
        stripped, ttl = strip_cache_control(tool)
        add(["tool", stripped], ttl)
    system = body.get("system")
    if isinstance(system, str):
        add(["system", system], None)
    elif isinstance(system, list):
        for block in system:
            stripped, ttl = strip_cache_control(block)
            add(["system", stripped], ttl)
    for i, msg in enumerate(body.get("messages") or []):
        content = msg.get("content") if isinstance(msg, dict) else None
        role = msg.get("role") if isinstance(msg, dict) else None
        if isinstance(content, str):
            add(["message", i, role, content], None)
            continue
        for block in content or []:
            stripped, ttl = strip_cache_control(block)
            add(["message", i, role, _counted(stripped)], ttl)
    return units, markers


class PromptCache:
    """Remembers prefix hashes until they expire (5 min, or 1 h with ttl "1h"), like the API's cache."""

    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = min_tokens
        self._expiry: dict[str, float] = {}

    def clear(self) -> None:
        self._expiry.clear()

    def usage(self, body: dict, *, record: bool = True) -> dict[str, int]:
        """Input-side usage for one request; caller holds the model's lock. ``record=False`` only
        looks: a request refused (a 429) writes nothing to the cache and refreshes nothing."""
        units, markers = cache_units(body)
        total = estimate_tokens(canonical(units))
        now = time.monotonic()
        if record:
            self._expiry = {k: t for k, t in self._expiry.items() if t > now}
        prefixes = []
        for pos, ttl in markers:
            text = canonical(units[: pos + 1])
            tokens = len(text) // 4
            if tokens >= self.min_tokens:  # shorter prefixes are silently not cached, as in the API
                key = hashlib.sha256(f"{body['model']}\0{text}".encode()).hexdigest()
                prefixes.append((tokens, key, CACHE_TTLS[ttl]))
        read = max((tokens for tokens, key, _ in prefixes if self._expiry.get(key, 0.0) > now), default=0)
        longest = max((tokens for tokens, _, _ in prefixes), default=0)
        creation = longest - read
        for _, key, ttl_s in prefixes if record else ():  # a hit refreshes the entry's lifetime, as in the API
            self._expiry[key] = max(self._expiry.get(key, 0.0), now + ttl_s)
        return {
            "input_tokens": max(0, total - read - creation),
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": read,
        }
