"""Two local processes joined by MLX's ring backend over loopback, for tests.

``RingPair(script, args)`` starts ``script`` twice (ranks 0 and 1) with the
environment ``mlx.launch --backend ring`` gives local processes (``MLX_RANK``,
``MLX_HOSTFILE``: a JSON list of one ``127.0.0.1:port`` per rank) and
``PYTHONPATH`` naming this checkout, so the children import this muser_kv.
Leaving the ``with`` block stops whichever of them still runs (by pid).
A child that cannot set up the ring (a port taken meanwhile) exits with
``INIT_FAILED``; the pair is then started again on fresh ports.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
#: A child's exit status when mx.distributed.init(backend="ring") fails.
INIT_FAILED = 75
ATTEMPTS = 3


def free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


class RingPair:
    def __init__(self, script: Path, args: Sequence[str], folder: Path):
        self.script, self.args, self.folder = script, list(args), folder
        self.procs: List[subprocess.Popen] = []

    def __enter__(self) -> "RingPair":
        self._start()
        return self

    def _start(self) -> None:
        hostfile = self.folder / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
        self.procs = []
        for rank in (0, 1):
            env = child_env({"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)})
            with open(self.folder / f"rank{rank}.log", "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(self.script), *self.args], env=env, cwd=ROOT,
                    stdout=log, stderr=subprocess.STDOUT))

    def wait(self, timeout: float) -> List[Optional[int]]:
        """Exit statuses once both exit (started again on fresh ports, at most
        ``ATTEMPTS`` times, when a child could not set up the ring), or None for
        one still running when ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        for attempt in range(ATTEMPTS):
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                if INIT_FAILED in [p.poll() for p in self.procs]:
                    break
                time.sleep(0.05)
            codes = [p.poll() for p in self.procs]
            if INIT_FAILED not in codes or attempt == ATTEMPTS - 1:
                return codes
            self.stop()
            self._start()
        return [p.poll() for p in self.procs]

    def log(self, rank: int) -> str:
        return (self.folder / f"rank{rank}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{self.log(r)}" for r in (0, 1))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def __exit__(self, *exc) -> None:
        self.stop()
