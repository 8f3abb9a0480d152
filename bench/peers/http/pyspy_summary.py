"""py-spy raw (collapsed) stacks of the kvidx service -> where its on-CPU Python time goes.
Each sample is attributed to the innermost frame that belongs to a known component (leaf first)."""
import collections
import os
import sys

RULES = [  # (component, predicate on "function (file:line)")
    ("canonical hashing of token ids (kvidx/core/hashing.py)", lambda f: "kvidx/core/hashing.py" in f),
    ("index lookup: AND-walk + resume points + per-replica answer dicts (kvidx/core/shard.py)",
     lambda f: "kvidx/core/shard.py" in f or "kvidx/core/pending.py" in f),
    ("prefix price per replica (kvidx/core/price.py)", lambda f: "kvidx/core/price.py" in f),
    ("response JSON encode (app.py _encode, msgspec)",
     lambda f: f.startswith("_encode ") or "_encode (" in f),
    ("request body read + JSON decode (app.py read_body/read_json, msgspec)",
     lambda f: f.startswith(("read_json ", "read_body ")) or f.startswith("_pack ")),
    ("service metrics (index_service/metrics.py, prometheus_client)",
     lambda f: "index_service/metrics.py" in f or "prometheus_client" in f),
    ("handler glue (index_service/app.py: answer, prompt, checks)", lambda f: "index_service/app.py" in f),
    ("FastAPI/Starlette (routing, middleware, Request/Response)",
     lambda f: "starlette/" in f or "fastapi/" in f or "anyio/" in f),
    ("uvicorn HTTP/1.1 protocol (httptools parse, transport write)", lambda f: "uvicorn/" in f),
    ("Kafka follower / feedback threads",
     lambda f: "follower.py" in f or "confluent_kafka" in f or "feedback.py" in f),
    ("asyncio / uvloop event loop", lambda f: "asyncio/" in f or "uvloop" in f),
]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
APP = os.path.join(os.environ.get("KVIDX_ROOT") or REPO, "index_service/app.py")


def app_line_kind():
    """index_service/app.py line -> component, for lines that call C code directly (msgspec)."""
    kinds = {}
    try:
        lines = open(APP).read().split("\n")
    except OSError:
        return kinds
    for i, t in enumerate(lines, 1):
        if "_encode(" in t:
            kinds[i] = kinds[i + 1] = "response JSON encode (app.py _encode, msgspec)"
        if "decoder.decode(" in t or "request.body()" in t or "_pack(" in t:
            kinds[i] = "request body read + JSON decode (app.py read_body/read_json, msgspec)"
    return kinds


def main():
    line_kind = app_line_kind()
    comp = collections.Counter()
    leaf = collections.Counter()
    total = 0
    for line in open(sys.argv[1]):
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        n = int(n)
        frames = stack.split(";")
        total += n
        leaf[frames[-1]] += n
        for f in reversed(frames):
            name = None
            if "index_service/app.py:" in f:
                try:
                    name = line_kind.get(int(f.rsplit(":", 1)[1].rstrip(")")))
                except ValueError:
                    pass
            name = name or next((c for c, pred in RULES if pred(f)), None)
            if name:
                comp[name] += n
                break
        else:
            comp["other"] += n
    print(f"samples: {total}")
    print("| component | share of on-CPU Python samples |\n|---|---:|")
    for c, n in comp.most_common():
        print(f"| {c} | {100 * n / total:.1f} % |")
    print("\ntop leaf frames (self time):")
    for f, n in leaf.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 20):
        print(f"  {100 * n / total:5.1f} %  {f}")


if __name__ == "__main__":
    main()
