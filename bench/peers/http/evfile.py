"""Reader of the common event file (bench/peers/gen/gen_events.py format)."""
import struct

import numpy as np

U64 = np.dtype("<u8")


def load(path):
    """-> (n_workers, block_tokens, records). Records:
    ("Q", seq[], local[], ids[])  ("S", worker, parent_seq|None, seq[], local[])  ("R", worker, seq[])"""
    data = open(path, "rb").read()
    assert data[:8] == b"KVEVTS01"
    nw, bt, n = struct.unpack_from("<IIQ", data, 8)
    p = 24
    recs = []
    for _ in range(n):
        t = data[p]
        p += 1
        if t == 0:
            (k,) = struct.unpack_from("<I", data, p)
            p += 4
            seq = np.frombuffer(data, U64, k, p).tolist()
            p += 8 * k
            loc = np.frombuffer(data, U64, k, p).tolist()
            p += 8 * k
            ids = np.frombuffer(data, U64, k, p).tolist()
            p += 8 * k
            recs.append(("Q", seq, loc, ids))
        elif t == 1:
            w, hp, par, k = struct.unpack_from("<IBQI", data, p)
            p += 17
            seq = np.frombuffer(data, U64, k, p).tolist()
            p += 8 * k
            loc = np.frombuffer(data, U64, k, p).tolist()
            p += 8 * k
            recs.append(("S", w, par if hp else None, seq, loc))
        elif t == 2:
            w, k = struct.unpack_from("<II", data, p)
            p += 8
            seq = np.frombuffer(data, U64, k, p).tolist()
            p += 8 * k
            recs.append(("R", w, seq))
        else:
            raise ValueError(t)
    return nw, bt, recs
