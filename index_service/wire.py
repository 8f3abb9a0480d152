"""What the lookup service is asked: the request bodies as msgspec structs (with their decoders and the
JSON schemas the OpenAPI document shows), the error a request is refused with, and the C-speed range
checks of token ids and block hashes. No HTTP here: the query pipeline uses these too."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from index_service.guard import MAX_DEPTH_ERROR, MAX_DP_RANK, MAX_NAME, NAME_PATTERN
from kvidx.core.maskmap import split_token_ids

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
MAX_TOP_K = 4096
MAX_COUNT = (1 << 31) - 1  # tokens of one prompt, a TTL's seconds ...: more is no request a router makes
# names that reach logs, metrics and topics: bounded, no control characters (index_service.guard)
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME, pattern=NAME_PATTERN)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_DP_RANK)]

# Token ids as packed little-endian uint32, converted in C (array range-checks every id).
_U32_CODE = next(c for c in ("I", "L") if array(c).itemsize == 4)
_SWAP = sys.byteorder != "little"


class LookupRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    # Range-checked in C by array("I") / array("Q"): a msgspec constraint per item costs more (and
    # msgspec bounds cannot express u64).
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    prompt_tokens: Count | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    top_k: Count | None = None  # only the best k replicas (by resumable tokens; /v1/rank: by price)


class RouteRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A routing decision: the prompt (as in a lookup), where it went, and what the index credited."""
    request_id: Name
    model: Name
    replica: Name
    dp_rank: Rank = 0
    credited_tokens: Count = 0
    ttl_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] | None = None
    router: Name = ""
    # the lookup answer's evicting_tokens for this replica (eviction foresight), for the audit
    evicting_tokens: Count = 0
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    prompt_tokens: Count | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class UsageRequest(msgspec.Struct, forbid_unknown_fields=True):
    """What an engine reused for a routed request (vLLM: usage.prompt_tokens_details.cached_tokens)."""
    request_id: Name
    model: Name
    replica: Name
    prompt_tokens: Count
    cached_tokens: Count
    dp_rank: Rank = 0
    engine: Name = ""
    tier: Name = ""
    router: Name = ""


LOOKUP_DECODER = msgspec.json.Decoder(LookupRequest)
ROUTE_DECODER = msgspec.json.Decoder(RouteRequest)
USAGE_DECODER = msgspec.json.Decoder(UsageRequest)
# The bodies' schemas inline (no $ref), for the routes' requestBody in the OpenAPI document
USAGE_SCHEMA = msgspec.json.schema_components([UsageRequest])[1]["UsageRequest"]
LOOKUP_SCHEMA = msgspec.json.schema_components([LookupRequest])[1]["LookupRequest"]
ROUTE_SCHEMA = msgspec.json.schema_components([RouteRequest])[1]["RouteRequest"]


class Reject(Exception):
    """A request refused: the HTTP status and the message (naming the field) the client gets."""

    def __init__(self, status: int, error: str):
        super().__init__(error)
        self.status = status
        self.error = error


def decode(decoder: msgspec.json.Decoder, body: bytes):
    """The body as the decoder's struct; 422 for a wrong field, 400 for bytes that are not JSON."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise Reject(422, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise Reject(400, f"invalid JSON: {e}") from None
    except RecursionError:
        raise Reject(400, f"invalid JSON: {MAX_DEPTH_ERROR}") from None


def read_lookup(body: bytes) -> LookupRequest:
    """A JSON lookup body. Where the compiled core is built, its token ids go from JSON text straight
    to packed uint32 bytes (`token_ids` is then those bytes: no Python int per token), cut out of the
    body before the rest is decoded; a body it does not take is decoded the ordinary way, so its error
    is the ordinary one."""
    req = read_split(LOOKUP_DECODER.decode, body)
    return req if req is not None else decode(LOOKUP_DECODER, body)


def read_split(decode_rest: Callable[[bytes], Any], body: bytes):
    """The body decoded with its token ids packed by the compiled parser (kvidx_native.split_token_ids;
    `decode_rest` reads the other members), or None where that parser is not built or does not take
    this body (then decode it the ordinary way: the error is the ordinary one)."""
    parts = split_token_ids(body) if split_token_ids is not None else None
    if parts is None:
        return None
    rest, packed = parts
    try:
        req = decode_rest(rest)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    req.token_ids = packed
    return req


def pack_tokens(token_ids: list[int] | bytes) -> bytes:
    """Token ids as packed little-endian uint32 (what prompt_hashes hashes), range-checked in C;
    bytes are packed already (read_lookup)."""
    if isinstance(token_ids, bytes):
        return token_ids
    try:
        a = array(_U32_CODE, token_ids)
    except (OverflowError, TypeError):
        i = next((i for i, t in enumerate(token_ids) if not 0 <= t <= U32_MAX), None)
        raise Reject(422, f"token_ids[{i}] is out of range: token ids are uint32 (0 to 2^32-1)"
                     ) from None
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def check_hashes(hashes: list[int]) -> None:
    """Every block hash a uint64 (checked in C); 422 naming the first that is not."""
    try:
        array("Q", hashes)
    except (OverflowError, TypeError):
        i = next((i for i, h in enumerate(hashes) if not 0 <= h <= U64_MAX), None)
        raise Reject(422, f"block_hashes[{i}] is out of range: hashes are uint64 (0 to 2^64-1)"
                     ) from None
