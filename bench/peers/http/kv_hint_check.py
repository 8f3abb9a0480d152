"""kvidx's fetch hints (kvidx.core.fetch, POST /v1/routes `kv_hint`) checked against Dynamo's own types.

Makes kvidx's KvHint JSON for a set of plans (edge cases: u64 hashes at 0, 2**63 and 2**64-1, long
chains, message ids that need escaping), pipes them through `kvhint_check` (dynserver/src/bin: the
published crate dynamo-kv-router 1.6.1's `KvHint`, `KvHintAction::fetch`, `KvSourceLocationsPayload`)
and prints, per hint, whether Dynamo parses it, re-serializes it to the same value, and makes the same
JSON text from the same fields with its own constructors. Exit 1 on any difference.

    python bench/peers/http/kv_hint_check.py [--bin PATH] [--write]

--write stores Dynamo's texts as tests/fixtures/dynamo-1.6.1/kv_hints.jsonl, the fixture the unit tests
hold kvidx's output to (tests/unit/core/test_fetch.py) without Rust in CI. Needs cargo (builds the
checker into bench/peers/.build/target unless --bin is given).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from kvidx.core.fetch import FetchPlan, dynamo_kv_hint  # noqa: E402

FIXTURE = ROOT / "tests/fixtures/dynamo-1.6.1/kv_hints.jsonl"

CASES = [
    ("req-17", "tcp://10.0.0.7:23280", [11, 22]),
    ("", "tcp://127.0.0.1:1", [0]),
    ("edge", "tcp://[::1]:25000", [2**63 - 1, 2**63, 2**64 - 1]),
    ("chain-64", "tcp://worker-3.svc:25000", [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, 65)]),
    ('quote"back\\slash\ttab', "tcp://h:2", [5]),
    ("r\u00e9q-\u2603-\u0001", "tcp://h:3", [6, 7]),
]


def hint_text(message_id: str, endpoint: str, hashes: list[int]) -> str:
    plan = FetchPlan("src", 0, endpoint, hashes, len(hashes) * 16, 0, 0.0, 0.0)
    return msgspec.json.encode(dynamo_kv_hint(message_id, plan)).decode()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", help="a built kvhint_check (default: build it with cargo)")
    ap.add_argument("--write", action="store_true", help="write Dynamo's texts as the unit tests' fixture")
    args = ap.parse_args()
    binary = args.bin
    if binary is None:
        target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "bench/peers/.build/target"))
        build = ["nice", "-n", "10", "cargo", "build", "--release", "-j", "2", "--bin", "kvhint_check"]
        subprocess.run(build,
                       cwd=Path(__file__).parent / "dynserver", check=True,
                       env={**os.environ, "CARGO_TARGET_DIR": target})
        binary = str(Path(target) / "release/kvhint_check")
    texts = [hint_text(*c) for c in CASES]
    out = subprocess.run([binary], input="\n".join(texts) + "\n", capture_output=True, text=True, check=True)
    results = [json.loads(x) for x in out.stdout.splitlines()]
    bad = 0
    for (mid, _, hashes), text, r in zip(CASES, texts, results, strict=True):
        ok = all(r.get(k) for k in ("parsed", "roundtrip", "payload_typed", "same_as_dynamo", "same_bytes"))
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} message_id={mid!r:28} hashes={len(hashes):3}  "
              + " ".join(f"{k}={r.get(k)}" for k in ("parsed", "roundtrip", "payload_typed", "same_as_dynamo",
                                                      "same_bytes")))
        if not ok:
            print(f"    kvidx:  {text}\n    dynamo: {r.get('dynamo', r.get('error'))}")
    print(json.dumps({"hints": len(texts), "differences": bad}))
    if args.write and not bad:
        FIXTURE.write_text("".join(json.dumps({"message_id": m, "endpoint": e, "engine_hashes": h,
                                               "dynamo": r["dynamo"]}) + "\n"
                                   for (m, e, h), r in zip(CASES, results, strict=True)))
        print(f"wrote {FIXTURE.relative_to(ROOT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
