"""How tests/data/session-v2-*.safetensors were made: by the version 2 writer
(muser-kv at commit a635083, the last to write version 2), run as

    git archive a635083 muser_kv | tar -x -C /tmp/v2
    PYTHONPATH=/tmp/v2:tests python tests/data/make_v2_sessions.py tests/data

Each file is a tiny Muse Glimmer (1 KV head x 16) at position 40, its rings
wrapped and rotated (a prefill chunk, then chunks of 5 and single tokens), in
f16 planes and in bf16 planes. tests/test_session_versions.py reads them with
today's reader."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import muser_kv
from conftest import tiny_model

assert muser_kv.snapshot.VERSION == "2", muser_kv.snapshot.VERSION
KW = dict(head_dim=16, num_key_value_heads=1)


def filled(model, position: int):
    cache = muser_kv.make_prompt_cache(model, 128)
    toks = [int(t) for t in (np.arange(position) * 7 + 3) % 251 + 1]
    sizes, i, k = [11, 1, 5, 1, 1], 0, 0
    while i < position:
        n = min(sizes[k % len(sizes)], position - i)
        model(mx.array([toks[i:i + n]]), cache=cache)
        i, k = i + n, k + 1
    return cache


out = Path(sys.argv[1])
for name, dtype in (("f16", mx.float32), ("bf16", mx.bfloat16)):
    model = tiny_model(dtype, **KW)
    muser_kv.save_session(out / f"session-v2-{name}.safetensors", filled(model, 40),
                          {"made by": "muser-kv a635083 (version 2)"})
