"""``muser-kv serve`` in a subprocess, for the tests that talk to it over HTTP
(loopback only, a free port each, stopped in any case by their fixtures)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np

from muser_kv.serving.server.shutdown import LISTENING

ROOT = Path(__file__).resolve().parents[1]
#: seconds a server may take to answer /health, and a request to be answered:
#: enough for 2 CPU cores; a run that starts many servers on one GPU at once
#: (the conformance suite's 30, each creating its CUDA context and warming up)
#: raises them (``MUSER_KV_TEST_SERVER_TIMEOUT``, both in seconds)
START_TIMEOUT = float(os.environ.get("MUSER_KV_TEST_SERVER_TIMEOUT", 90))
REQUEST_TIMEOUT = max(60.0, START_TIMEOUT * 2 / 3)


def end(proc: "subprocess.Popen[bytes] | None") -> None:
    """Stop a child process: terminate, then kill after 10 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``python -m muser_kv``, with the tests' stand-ins for mlx-lm's Metal kernels
#: installed first (``mlx_lm_kernels``: Muse Spark's forward, off Apple silicon)
WITH_STANDINS = ("import sys, mlx_lm_kernels; mlx_lm_kernels.install(); "
                 "from muser_kv.serving.cli import main; sys.exit(main(sys.argv[1:]))")


class Server:
    """``muser-kv serve`` in a subprocess; ``stop`` ends it (terminate, then kill).
    ``mlx_lm_standins``: the child runs Muse Spark on ``mlx_lm_kernels``' stand-ins
    where it has no Metal, as the tests in this process do. ``env``: variables
    set in the child's environment beside this process's."""

    def __init__(self, model: Path, log: Path, *flags: str, mlx_lm_standins: bool = False,
                 env: Optional[Dict[str, str]] = None):
        self.port = 0  #: the port the server announced (``wait_ready``)
        self.log_path = log
        self._log = open(log, "w")
        env = dict(os.environ, **(env or {}), PYTHONPATH=str(ROOT))
        command = [sys.executable, "-m", "muser_kv"]
        if mlx_lm_standins:
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
            command = [sys.executable, "-c", WITH_STANDINS]
        self.proc = subprocess.Popen(
            [*command, "serve", "--model", str(model), "--host",
             "127.0.0.1", "--port", "0", "--log-level", "WARNING", *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))

    def log(self) -> str:
        return self.whole_log()[-4000:]

    def whole_log(self) -> str:
        """Everything the server has written (stdout and stderr)."""
        self._log.flush()
        return self.log_path.read_text()

    def get(self, path: str, timeout: float = 5) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                        timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def wait_ready(self) -> None:
        """Wait for the port the server announces, then for it to answer /health.
        The server binds port 0 itself: a port picked here and bound there later
        could be bound meanwhile by another server, which would then answer."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            if not self.port:
                found = LISTENING.search(self.whole_log())
                if not found:
                    time.sleep(0.2)
                    continue
                self.port = int(found.group(1))
            try:
                if self.get("/health", timeout=2) == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {START_TIMEOUT} s:\n{self.log()}")

    def send(self, path: str, body: Dict[str, Any]):
        """(HTTP status, the JSON body)."""
        data = json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def post(self, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        status, out = self.send(path, body)
        assert status == 200, f"{path} -> {status} {out!r}\n{self.log()}"
        return out

    def stop(self) -> None:
        end(self.proc)
        self._log.close()


def ids(n: int, seed: int) -> List[int]:
    """``n`` token ids of the tiny models' vocabulary, none of the special ones."""
    return [int(t) for t in np.random.default_rng(seed).integers(2, 250, n)]


@contextmanager
def serving(servers: Mapping[str, "Server"]) -> Iterator[Mapping[str, "Server"]]:
    """``servers`` once each answers ``/health``; every one stopped afterwards,
    whatever happened (a fixture's body)."""
    try:
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def words(ids: Sequence[int]) -> str:
    """Token ids as the local tokenizer's words (``t{id}``)."""
    return " ".join(f"t{i}" for i in ids)


def openai_error(message: str, status: int = 400, code: str = "invalid_request") -> Dict[str, Any]:
    """The body ``muser-kv serve`` answers a refusal with: OpenAI's error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


#: Set by .ci/run: there a missing ``redis-server`` fails the Redis tests instead of skipping them.
REQUIRE_REDIS_ENV = "MUSER_KV_REQUIRE_REDIS"


class RedisMissing(RuntimeError):
    """No ``redis-server`` on PATH (Debian: ``apt-get install -y redis-server``)."""


class PortTaken(AssertionError):
    """The free port picked for a server was bound by another before it."""


class RedisServer:
    """Debian's ``redis-server`` on a free loopback port, no persistence, its
    files in ``workdir``: ``url``, ``kill()`` (SIGKILL, as a crash),
    ``restart()`` (a fresh, empty server on the same port), ``stop()``."""

    def __init__(self, workdir: Path, *flags: str):
        import shutil

        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisMissing("redis-server is not installed (apt-get install -y redis-server)")
        self.exe = exe
        self.workdir = Path(workdir)
        self.flags = flags
        self.proc: "subprocess.Popen[bytes] | None" = None
        for attempt in range(3):  # a port taken between free_port and redis's bind: another
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
            try:
                self.start()
                return
            except PortTaken:
                if attempt == 2:
                    raise

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.workdir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no", *self.flags],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited {self.proc.returncode}:\n"
                                     f"{(self.workdir / 'redis.log').read_text()[-2000:]}")
            answering = self.pid()
            if answering == self.proc.pid:
                return
            if answering is not None:  # another server holds the port; ours will exit
                self.stop()
                raise PortTaken(f"port {self.port} is another redis-server's (pid {answering})")
            time.sleep(0.02)
        self.stop()
        raise AssertionError(f"redis-server not answering on port {self.port} after 10 s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def pid(self) -> Optional[int]:
        """The process id of the redis-server answering on the port (None: none answers)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"INFO server\r\n")
                got = b""
                while b"process_id:" not in got or not got.split(b"process_id:")[1].count(b"\r\n"):
                    more = s.recv(4096)
                    if not more:
                        return None
                    got += more
                return int(got.split(b"process_id:")[1].split(b"\r\n")[0])
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        end(self.proc)
        self._log.close()


def generation_args(max_tokens: int, logprobs: bool = True) -> Any:
    """mlx-lm's server's arguments for one greedy request, as its handler builds
    them, for a generation thread fed in this process."""
    import mlx_lm.server as s

    return s.GenerationArguments(
        model=s.ModelDescription("default_model", "default_model", None),
        sampling=s.SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.0),
        logits=s.LogitsProcessorArguments(None, 1.0, 20, 0.0, 20, 0.0, 20),
        stop_words=[], max_tokens=max_tokens, num_draft_tokens=3, logprobs=logprobs,
        top_logprobs=0, seed=None, chat_template_kwargs=None)


def serve_args(argv: Sequence[str]) -> Any:
    """The namespace ``muser-kv serve argv`` parses, through mlx-lm's own
    ``main`` with its server loop stubbed out; the substituted names are put back."""
    from muser_kv.serving.server import serve
    from muser_kv.serving.server.mlx_lm_server import server

    captured: Dict[str, Any] = {}

    def run(host: str, port: int, provider: Any) -> None:
        captured["args"] = provider.cli_args

    with serve.substituted(list(argv)):
        saved, server.run = server.run, run
        try:
            server.main()
        finally:
            server.run = saved
    assert server.ModelProvider is not serve.MuseModelProvider  # put back
    return captured["args"]
