"""``benchmarks/serve_http.py``, the benchmark of the server as a client meets
it, run small on this machine as the harness's test: a tiny Muse Glimmer, a
600-token chat, both servers driven over loopback HTTP. It exits 0, every
muser-kv request is answered, and muser-kv's answers to the same request (turn
3, its regenerate after other chats, its regenerate after a restart over the
same ``--kv-store``) are reported identical token for token, and equal to a
fresh server's (on the CPU a rebuilt or reused state is the live one bit for
bit, so greedy answers agree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import metal_plugin
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_http_benchmark_runs_small_and_reports_identical_answers(tmp_path):
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the servers run the commands themselves, which do not install the tests' "
                    "Metal emulator")
    out = tmp_path / "serve_http.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_http.py"), "--history", "600",
         "--traffic", "2", "--geometry", "tiny", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"muser", "mlx-lm"}
    muser = results["muser"]
    assert muser["failure"] is None
    assert [r["request"] for r in muser["requests"]] == [
        "turn 1", "turn 2", "turn 3", "regenerate", "edit", "branch",
        "regenerate after restart", "fresh server, turn 3"]
    assert all(r["status"] == 200 and r["ttft_s"] is not None for r in muser["requests"])
    # the restarted server rebuilt the chat from the directory the first one wrote
    restart = muser["requests"][6]
    assert restart["store_rebuilt"] == restart["prompt_tokens"] - 1
    # the server's own profile of the wait before the prefill, in each request's log window:
    # the entries' lookup, then the store's, with what it read from the directory
    path = [m for _, m in restart["log"] if m.startswith("muser-kv request path:")]
    assert len(path) == 1 and f"rebuilt {restart['store_rebuilt']};" in path[0], restart["log"]
    read = int(path[0].split("; ")[1].split(" B read")[0])
    assert read > 0, path  # a restart's memory tier is empty: every chunk came from the directory
    # every start (the first, the restart, the fresh server) warmed up before /health said 200
    assert len(muser["starts"]) == 3 and all(
        x["warm_up_s"] is not None and x["warm_up_s"] < x["ready_s"] for x in muser["starts"])
    assert all(x["warm_up_s"] is None for x in results["mlx-lm"]["starts"])
    assert "muser-kv serve ready (/health 200) after each start:" in run.stdout
    edit = muser["requests"][4]
    assert any(m.startswith("muser-kv request path: entries") for _, m in edit["log"]), edit["log"]
    same = muser["identity"]
    assert same["repeats_identical"] is True
    assert same["equal_fresh"] is True
    assert "identical token for token: True" in run.stdout
