"""perf report (flat self time by symbol) of the Dynamo server -> components (approximate: symbols are
bucketed by name; first matching rule wins)."""
import collections
import re
import subprocess
import sys

RULES = [
    ("kernel (TCP loopback send/recv, epoll, futex, scheduling)", lambda s: s.startswith("[k]")),
    ("token hashing (xxh3, compute_block_hash_for_seq)",
     lambda s: "xxh3" in s.lower() or "compute_block_hash" in s),
    ("index lookup (dynamo_kv_router::indexer, radix tree walk)",
     lambda s: "dynamo_kv_router::indexer" in s or "radix" in s.lower() or "find_matches" in s),
    ("request JSON parse (serde_json de)", lambda s: "serde_json::de" in s or "Deserialize" in s
     or "serde_path_to_error" in s or "parse_integer" in s or "Deserializer" in s),
    ("response build + JSON serialize (build_score_response, serde_json::Value, BTreeMap, HashMap)",
     lambda s: any(k in s for k in ("serde_json", "serde_core::ser", "btree", "BTreeMap",
                                     "build_score_response", "overlap", "itoa", "hashbrown", "HashMap",
                                     "hash::sip", "BuildHasher", "Serialize", "ryu"))),
    ("malloc/free + mem* (libc)", lambda s: re.search(r"malloc|free|_int_|unlink_chunk|consolidate|realloc|"
                                                   r"memmove|memcpy|memset|memcmp|tcache", s) is not None),
    ("HTTP stack (hyper, axum, tower, http)",
     lambda s: any(k in s for k in ("hyper", "axum", "tower", "http::", "httparse"))),
    ("tokio runtime / mio / sync",
     lambda s: any(k in s for k in ("tokio", "mio", "parking_lot", "crossbeam", "futex", "pthread", "syscall",
                                    "epoll", "__GI_"))),
]


def main():
    data = sys.argv[1]
    out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "sym", "-g", "none",
                          "--stdio"], capture_output=True, text=True).stdout
    comp = collections.Counter()
    top = []
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\[.\])\s+(.*)$", line)
        if not m:
            continue
        pct, kind, sym = float(m.group(1)), m.group(2), m.group(3).strip()
        s = f"{kind} {sym}"
        top.append((pct, s))
        name = next((c for c, pred in RULES if pred(s)), "other")
        comp[name] += pct
    tot = sum(comp.values())
    print(f"perf samples share (self time), total {tot:.1f} %")
    print("| component | share of the server's on-CPU samples |\n|---|---:|")
    for c, v in comp.most_common():
        print(f"| {c} | {v:.1f} % |")
    print("\ntop symbols (self):")
    for pct, s in top[: int(sys.argv[2]) if len(sys.argv) > 2 else 25]:
        print(f"  {pct:5.2f} %  {s[:150]}")


if __name__ == "__main__":
    main()
