"""How long does the KV store's write-behind thread hold the GIL while it encodes a chunk?

The store encodes every chunk it writes to a byte tier on its write-behind
thread (``chunks.encode``) while the server's generation thread builds decode
steps in Python: whatever the encoder does under the GIL, the generation
thread waits for. Here one ``Rows`` of ``--layers`` layers x ``--tokens``
tokens x ``--dim`` (bf16, on the device's memory as the store's arrays are)
is encoded ``--repeats`` times while another thread does nothing but note the
longest time between two of its loop iterations: that longest wait, and the
encoding time, for ``chunks.encode`` and for the copies of the encoder it
replaced (each array's ``tobytes``, joined into one ``bytes``).

    PYTHONPATH=. .venv/bin/python benchmarks/encode_gil.py
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any, Callable, Tuple

import mlx.core as mx
import numpy as np

from muser_kv.sessions.store import chunks


def longest_wait(encode: Callable[[Any, str], Any], obj: Any, repeats: int) -> Tuple[float, float]:
    stop, longest = [False], [0.0]

    def spin() -> None:
        last = time.perf_counter()
        while not stop[0]:
            now = time.perf_counter()
            longest[0] = max(longest[0], now - last)
            last = now

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    start = time.perf_counter()
    for _ in range(repeats):
        encode(obj, "bf16le")
    seconds = (time.perf_counter() - start) / repeats
    stop[0] = True
    t.join()
    return seconds, longest[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.integers(0, 1 << 16, (args.layers, args.tokens, args.dim),
                                  dtype=np.uint16)).view(mx.bfloat16) for _ in range(2))
    rows = chunks.Rows(0, args.tokens, tuple(range(args.layers)),
                       (chunks.Block(tuple(range(args.layers)), k, v),))
    mx.eval(k, v)
    size = chunks.encoded_size(rows, "bf16le")
    print(f"a chunk of {size / 1e6:.1f} MB, {args.repeats} encodes each, "
          f"{mx.default_device()}")
    for name, encode in (("tobytes, joined", _before), ("chunks.encode", chunks.encode)) * 2:
        seconds, wait = longest_wait(encode, rows, args.repeats)
        print(f"  {name:>16}: {seconds * 1e3:7.1f} ms per chunk; another thread's longest "
              f"wait for the GIL {wait * 1e3:6.1f} ms")


def _before(obj: Any, encoding: str) -> bytes:
    """The copies of the encoder ``chunks.encode`` replaced: each array's
    ``tobytes``, joined into one ``bytes`` (its header and padding left out)."""
    return b"".join(np.asarray(a.view(mx.uint16)).tobytes() for a in chunks.arrays_of(obj))


if __name__ == "__main__":
    main()
