"""Speculative decoding: blocks keyed on token pairs turned back into single tokens.

Which engine does it:
- SGLang with EAGLE keys its radix tree on bigrams: `convert_to_bigram_key` turns [t0, t1, t2, ...]
  into [(t0, t1), (t1, t2), ...] (python/sglang/srt/mem_cache/utils.py), and the KV-event mixin
  "preserves historical event payload: bigram pages expose tuples": a page's BlockStored token_ids
  are [(raw[j], raw[j + 1]) for j in range(start, end)] (python/sglang/srt/mem_cache/
  kv_cache_event_mixin.py `_record_store_event`), msgpack arrays of two ints on the wire.
- vLLM 0.32 does not: with EAGLE/MTP its block hashes stay over single tokens; it only drops the
  last matched block of a hit to recompute the drafting head's hidden states
  (vllm/v1/core/single_type_kv_cache_manager.py, `drop_eagle_block`, 0.32.0). That is a resume-point
  rule (one block less), not a keying difference, so vLLM events need no conversion.
- TensorRT-LLM events carry tokens as {token_id, token_extra_id} (tensorrt_llm/_utils.py
  KVCacheEventSerializer): token_extra_id is a multimodal/extra id, not a draft pair.

A bigram page [(a, b), (b, c), (c, d)] holds the KV of a, b, c (the pair's first element is the
token; the second is the next token, which the draft model is conditioned on). Its single-token page
is [a, b, c]: the same prefix hashes the same with or without drafting. The last pair's second
element is the next page's first token (a consistency check across pages).
"""

from __future__ import annotations

from collections.abc import Sequence


class SpecDecodeError(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def is_bigram_page(token_ids: Sequence) -> bool:
    return bool(token_ids) and isinstance(token_ids[0], list | tuple)


def unpair_tokens(token_ids: Sequence) -> tuple[list[int], int | None]:
    """(single tokens, the next token the last pair names) of a bigram page; a page of plain ints is
    returned as is with None. Raises SpecDecodeError for pairs that are not a bigram chain (each
    pair's second token must be the next pair's first)."""
    if not is_bigram_page(token_ids):
        return list(token_ids), None
    out: list[int] = []
    prev_next = None
    for i, p in enumerate(token_ids):
        if not isinstance(p, list | tuple) or len(p) != 2 or not all(isinstance(x, int) for x in p):
            raise SpecDecodeError("bad_bigram", f"token pair {i} is {p!r}")
        if prev_next is not None and p[0] != prev_next:
            raise SpecDecodeError("broken_bigram_chain", f"pair {i} starts with {p[0]}, expected {prev_next}")
        out.append(p[0])
        prev_next = p[1]
    return out, prev_next
