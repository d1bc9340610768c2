"""The payload codec: how a fact's payload becomes JSON text and comes back. Pure; no I/O.

Terms. A *payload* is the Python value a writer appends (anything JSON can say). Its *text* is
the strict compact JSON that PostgreSQL stores in the ``jsonb`` column ``streams_facts.payload``
and that a signed range carries as it was read (`streams.core.signing`). Every place that turns
one into the other calls this module, so a change of codec (a faster parser, payload
encryption) is one change:

* writers: `encode_payload` (a typed error before any I/O: not serialisable, NUL, lone
  surrogate, over the stream's limit);
* readers of pages and of signed ranges: `decode_payloads` (a page's column at once) and
  `decode_payload` (one value; also psycopg's ``jsonb`` loader on reader sessions,
  `streams.store.sessions.use_payload_decoder`);
* the prober and the readers of signed ranges: the rows a range seals carry the payload text
  as read (`streams.core.signing`), decoded by `decode_payloads` like a page.
"""

from __future__ import annotations

import json
from typing import Any, Final

import orjson

from ..errors import PayloadNotSerializable, PayloadTooLarge

__all__ = ["decode_payload", "decode_payloads", "encode_payload"]

# One encoder for every payload: json.dumps with options builds a new encoder per call.
_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def encode_payload(payload: Any, limit: int) -> str:
    """Strict compact JSON text for a payload, or a typed error (nothing is written)."""
    try:
        text = _ENCODER.encode(payload)
    except (TypeError, ValueError, RecursionError) as exc:
        raise PayloadNotSerializable(f"payload is not JSON-serialisable: {exc}") from None
    if "\\u0000" in text:
        # PostgreSQL's jsonb cannot store NUL characters; fail here, not half-way in a batch.
        raise PayloadNotSerializable("payload contains a NUL character (\\u0000)")
    if text.isascii():
        size = len(text)
    else:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            # A lone surrogate ("\ud800"): valid in a Python str, not in UTF-8 or PostgreSQL.
            raise PayloadNotSerializable(
                "payload contains a lone surrogate character: not valid Unicode"
            ) from None
    if size > limit:
        raise PayloadTooLarge(size, limit)
    return text


def decode_payload(data: bytes | str) -> Any:
    """A payload's text -> Python: orjson (a quarter faster end to end when catching up,
    measured), falling back to the standard library for what orjson refuses (integers beyond
    64 bits, numbers beyond float range) so every stored payload still reads."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def decode_payloads(texts: list[Any]) -> list[Any]:
    """A page's payload column, read as JSON text, -> Python values: one ``map`` over orjson
    (a fifth faster end to end when catching up than psycopg's loader per value, measured);
    value by value with `decode_payload` (and NULL as None) if orjson refuses any of them."""
    try:
        return list(map(orjson.loads, texts))
    except (orjson.JSONDecodeError, TypeError):
        return [None if text is None else decode_payload(text) for text in texts]
