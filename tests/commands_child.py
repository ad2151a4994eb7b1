"""Child process of test_commands: runs ``muser-kv`` commands one after another
in this process, through ``muser_kv.serving.cli.main``, each with its own stdin and
stdout file, and records every response mlx-lm's ``stream_generate`` hands out
(token and log-probabilities) so the test can compare runs bit for bit.

``argv[1]`` is a JSON list of runs: ``{"argv": [...], "stdin": str,
"stdout": path, "record": path}``; each run's record is an ``.npz`` with
``tokens``, ``logprobs`` (f32, exact for bf16/f16 models) and ``rc``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys

import mlx.core as mx
import numpy as np

from muser_kv.serving.cli import main as muser_kv

# (the package's ``mlx_lm.generate`` attribute is the function: ask for the modules)
MODULES = tuple(importlib.import_module(f"mlx_lm.{name}") for name in ("chat", "generate"))


class Recorder:
    """mlx-lm's ``stream_generate``, recording what each response carries."""

    def __init__(self, stream_generate):
        self.inner = stream_generate
        self.tokens: list = []
        self.logprobs: list = []

    def __call__(self, *args, **kwargs):
        for response in self.inner(*args, **kwargs):
            self.tokens.append(response.token)
            self.logprobs.append(np.array(response.logprobs.astype(mx.float32)))
            yield response


def run(spec: dict) -> None:
    originals = [m.stream_generate for m in MODULES]
    recorder = Recorder(originals[0])
    for m in MODULES:
        m.stream_generate = recorder
    stdin = sys.stdin
    try:
        sys.stdin = io.StringIO(spec["stdin"])
        with open(spec["stdout"], "w") as out, contextlib.redirect_stdout(out):
            rc = muser_kv(spec["argv"])
    finally:
        sys.stdin = stdin
        for m, original in zip(MODULES, originals):
            m.stream_generate = original
    np.savez(spec["record"], tokens=np.array(recorder.tokens, dtype=np.int64),
             logprobs=np.stack(recorder.logprobs) if recorder.logprobs else np.zeros((0, 0)),
             rc=rc)


if __name__ == "__main__":
    for spec in json.loads(sys.argv[1]):
        run(spec)
