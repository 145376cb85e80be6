"""How many pages a PDF sent to the model has, without a PDF library: the model counts a PDF by its
pages (each page's text and an image of it), not by the length of its base64 data, so the token
estimates (``agentpool.runtime.estimate.estimate_tokens``) and the scripted model count its pages.

A page is a ``/Type /Page`` object. Written plainly, or (PDF 1.5 and later) packed into compressed
object streams (``/Type /ObjStm``, Flate-encoded), which are inflated to look inside. A PDF whose pages
this cannot see (an unknown filter, a damaged file) has None: its caller counts it some other way.
"""

from __future__ import annotations

import base64
import binascii
import re
import zlib

PDF_MEDIA_TYPE = "application/pdf"
_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z])")  # not /Pages, the page tree's nodes
_OBJECT_STREAM = re.compile(rb"/Type\s*/ObjStm\b")
_STREAM_START = re.compile(rb"stream\r?\n")


def pdf_block_data(block: object) -> str | None:
    """The base64 data of a ``document`` content block holding a PDF, else None."""
    if not isinstance(block, dict) or block.get("type") != "document":
        return None
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64" or source.get("media_type") != PDF_MEDIA_TYPE:
        return None
    data = source.get("data")
    return data if isinstance(data, str) else None


def pdf_pages(data: str) -> int | None:
    """The number of pages of the PDF ``data`` (base64), or None if it shows none."""
    try:
        raw = base64.b64decode(data)
    except (binascii.Error, ValueError):
        return None
    if b"%PDF-" not in raw[:1024]:
        return None
    pages = len(_PAGE.findall(raw))
    for packed in _OBJECT_STREAM.finditer(raw):
        start = _STREAM_START.search(raw, packed.end())
        end = raw.find(b"endstream", start.end()) if start else -1
        if end < 0:
            continue
        try:
            # A decompressor object, not zlib.decompress: the end-of-line before "endstream" is not Flate data.
            pages += len(_PAGE.findall(zlib.decompressobj().decompress(raw[start.end() : end])))
        except zlib.error:
            continue  # another filter, or damaged: its pages are not seen
    return pages or None
