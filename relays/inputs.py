"""What an input file or stream is, told before it is used: a missing file, a requests log given as a
recording, or a recording of another engine than the one asked for gets one line that names it.

Without these checks a missing file raised after the topics were created, a requests log raised a
ValueError traceback, and a vLLM recording shadowed as TensorRT-LLM reported recall 0.0 without a
word. Nothing here prints or keeps token ids: only a line's keys and event field names are read.
"""

from __future__ import annotations

import json
from pathlib import Path

# what a file's first line holds, by kind
KINDS = {
    "frames": "a recording of engine ZMQ frames (frames.jsonl: vLLM, SGLang, LMCache)",
    "polls": "a recording of TensorRT-LLM /kv_cache_events polls (events.jsonl)",
    "requests": "a requests log (requests.jsonl: prompts and the engine's cached_tokens)",
}


class InputError(ValueError):
    """An input the command cannot use; its message is the one line to show."""


def file_kind(path: str | Path) -> str:
    """"frames", "polls", "requests" or "unknown", from the first non-empty line's keys."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                break
        else:
            return "empty"
    try:
        d = json.loads(raw)
    except ValueError:
        return "unknown"
    if not isinstance(d, dict):
        return "unknown"
    if "payload_b64" in d:
        return "frames"
    if "prompt_token_ids" in d or "cached_tokens" in d:
        return "requests"
    if "events" in d and "recv_ns" in d:
        return "polls"
    return "unknown"


def check_file(path: str | Path | None, want: str, option: str) -> None:
    """Raise InputError unless `path` exists and is a file of kind `want`."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise InputError(f"{option} {path}: no such file")
    if p.is_dir():
        raise InputError(f"{option} {path}: is a directory, not a file")
    kind = file_kind(p)
    if kind == want:
        return
    if kind == "empty":
        raise InputError(f"{option} {path}: the file is empty")
    what = KINDS.get(kind, "not a file kvidx reads")
    hint = ""
    if kind in ("frames", "polls"):
        hint = f" (use --engine {' or '.join(engines_reading(kind))})"
    elif kind == "requests":
        hint = " (the recording is the frames.jsonl or events.jsonl beside it)"
    raise InputError(f"{option} {path}: this is {what}, not {KINDS[want]}{hint}")


def check_recording_engine(path: str | Path, engine: str, frames: int = 50) -> None:
    """Raise InputError when the first frames of a recording are plainly another engine's."""
    from kvidx.engines.recording import read_frames
    from kvidx.engines.sniff import wrong_engine

    for i, f in enumerate(read_frames(path)):
        if f.src == "keyfeed":  # an attached engine's frames in a pool's recording (Mooncake): theirs
            continue
        why = wrong_engine(f.payload, engine)
        if why is not None:
            raise InputError(f"{path}: {why}")
        if i >= frames:
            return


def engines_reading(kind: str) -> list[str]:
    """The registered engines whose recordings are of `kind` ("frames" or "polls")."""
    from kvidx import engines

    return [n for n in engines.names() if engines.get(n).recording == kind]
