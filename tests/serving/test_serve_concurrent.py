"""``benchmarks/serve_concurrent.py``, many chats at once through HTTP, run
small on this machine: a tiny Muse Glimmer, four streaming chats of 40 to 240
tokens (two sharing a system message) sent 50 ms apart, so that they join a
running batch and leave it. Every request is answered, and every answer under
load equals the same request's answer from a fresh server one request at a
time (temperature 0): joining a batch changes no chat's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import metal_plugin
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_concurrent_chats_get_their_answers_alone(tmp_path):
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the servers run the commands themselves, which do not install the tests' "
                    "Metal emulator")
    out = tmp_path / "concurrent.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_concurrent.py"), "--geometry", "tiny",
         "--clients", "4", "--history", "240", "--min-history", "40", "--answer", "24",
         "--stagger", "0.05", "--no-eos", "--check-alone", "--systems", "muser,reference",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    muser = json.loads(out.read_text())["results"]["N=4"]["muser"]
    assert muser["failure"] is None and muser["failed"] == []
    rows = muser["requests"]
    assert [len(r["answer"]) for r in rows] == [24] * 4
    assert muser["alone"] == [r["answer"] for r in rows]
    # they ran together: every request after the first was sent before the one before it ended
    assert all(b["sent"] < a["ended"] for a, b in zip(rows, rows[1:]))
