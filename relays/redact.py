"""Dead letters without prompt tokens.

A malformed engine message still goes to the dead-letter topic for a post-mortem, but the index
never stores prompt tokens: token id lists are replaced by their length. Maps lose their
"token_ids" values; vLLM's positional BlockStored arrays lose element 3. A payload that is not
msgpack at all (or truncated msgpack, which may still hold token ids) is cut to its first bytes,
its length and its sha256.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

KEEP_PREFIX = 32  # bytes of an undecodable payload kept: enough to see what it was, too few for a prompt
_TOKEN_KEYS = {"token_ids", "tokens", "prompt_token_ids", "output_token_ids"}


def _scrub(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: ({"redacted_token_ids": len(v)} if k in _TOKEN_KEYS and isinstance(v, list) else _scrub(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        if len(obj) > 3 and obj[0] == "BlockStored" and isinstance(obj[3], list):
            obj = [*obj[:3], {"redacted_token_ids": len(obj[3])}, *obj[4:]]
        return [_scrub(x) for x in obj]
    return obj


def redact(payload: bytes) -> tuple[bytes, str]:
    """(what may be stored, how it was redacted: "scrubbed" or "truncated")."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError):
        digest = hashlib.sha256(payload).hexdigest()
        head = payload[:KEEP_PREFIX]
        return msgspec.msgpack.encode({"len": len(payload), "sha256": digest, "head": head}), "truncated"
    return msgspec.msgpack.encode(_scrub(obj)), "scrubbed"
