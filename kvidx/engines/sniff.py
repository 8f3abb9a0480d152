"""Which engine a ZMQ stream is, from fields only one engine sends: a relay never folds another
engine's stream as its own (SGLang and vLLM share the envelope: one decodes as the other, misread).
Only field names and hash signs are read, never token ids."""

from __future__ import annotations

import msgspec

# BlockStored fields vLLM (0.32: always sent) has and SGLang never sends, and SGLang's own
_VLLM_ONLY = frozenset({"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"})
_SGLANG_ONLY = frozenset({"cache_salt", "session_id"})


def sniff_engine(payload: bytes) -> str | None:
    """"vllm", "sglang" or "mooncake" when a ZMQ event payload carries fields only that engine sends;
    None when it cannot tell (positional encodings, removals only, not msgpack)."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        return None
    for ev in batch[1]:
        if isinstance(ev, dict) and "event_type" in ev:
            return "mooncake"  # RFC #1527's envelope (Mooncake Store's master); vLLM/SGLang never send it
        if isinstance(ev, dict) and ev.get("type") == "BlockStored":
            keys = ev.keys()
            if _VLLM_ONLY & keys:
                return "vllm"
            if _SGLANG_ONLY & keys:
                return "sglang"
            hashes = ev.get("block_hashes")
            if isinstance(hashes, list) and any(isinstance(h, int) and h < 0 for h in hashes):
                return "sglang"  # signed int64 page hashes; vLLM's are unsigned or bytes
    return None


def wrong_engine(payload: bytes, engine: str) -> str | None:
    """A one-line reason when `payload` is plainly another engine's than `engine` (vllm, sglang,
    lmcache: LMCache's stores come through vLLM), else None."""
    seen = sniff_engine(payload)
    family = "vllm" if engine == "lmcache" else engine
    if seen is None or seen == family:
        return None
    why = {"vllm": "its BlockStored events carry vLLM's group_idx/kv_cache_spec_kind/extra_keys",
           "sglang": "its BlockStored events carry SGLang's signed page hashes or fields",
           "mooncake": "its events carry RFC #1527's event_type envelope"}[seen]
    return f"this is a {seen} stream ({why}), not {engine}: use --engine {seen}"
