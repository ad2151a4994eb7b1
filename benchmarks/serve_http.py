"""A returning chat through HTTP: how soon does `muser-kv serve --kv-store` answer, against `mlx_lm.server`?

A model directory is written first (``--model-dir``, kept and reused where it
already holds a ``config.json``): ``--geometry glimmer-real`` is the real Muse
Glimmer (52 layers, hidden 6656, vocab 202,048: ``_harness``'s defaults),
``--geometry tiny`` a family of the conformance suite (``--family``, a name of
``tests/model_zoo.ZOO``) at its tiny test geometry; random weights (seeded)
in ``--dtype``, saved with safetensors (mlx-lm's ``save_model``), and the
tests' local word-level tokenizer (``t0`` .. ``t{vocab-2}``, so one word is
one token) with a plain chat template: every message's content, an assistant
message after the generation marker ``t1`` (so a prompt plus its answer is a
prefix of the next turn's prompt).

Each system of ``--systems`` is then started as a subprocess (``python -m
muser_kv serve --kv-store DIR``, ``python -m mlx_lm.server``; one at a time, a
free loopback port, ``--log-level INFO``, its log kept) and driven by a plain
HTTP client: streaming chat completions at temperature 0, every request
bounded (``--request-timeout``). The requests, in order:

1. a chat of three turns ending at ``--history`` tokens: a long system message
   (up to 2,000 words) and a first message, then a ~200- and a ~150-word
   message, each answered with ``--answer`` tokens;
2. ``--traffic`` other users' short chats (up to 2,048 tokens each);
3. *regenerate* turn 3 (the same request), *edit* the last message (another
   third message), *branch* from turn 2 (the chat up to the first answer and
   another second message);
4. the server restarted over the same store (its write-behind drained first),
   and *regenerate* again.

Then a fresh muser-kv server with no store answers turn 3 (a prefill from
nothing). Printed per request and system: TTFT (to the first streamed chunk
with content), the prompt tokens and what was reused (the usage's
``cached_tokens``; muser-kv's log line "rebuilt N tokens from the KV store"),
and, for muser-kv, the server's log lines inside the request's time, at their
offsets from when it was sent (the request path as the log shows it). Then
whether muser-kv's answers to the same request (turn 3, its regenerate after
the traffic, after the restart) are identical token for token, and whether
they equal the fresh server's. A system that fails (not 200, no answer, died)
is a row with its status and its last log line, never a crash; where
mlx_lm.server fails, mlx-lm's own prefill of the same request is timed in this
process instead (``--fallback``: ``mlx_lm.load``, its caches, ``generate_step``
to the first token), and said to be that.

    # CPU, a tiny Muse Glimmer (well under a minute on two cores)
    PYTHONPATH=. .venv/bin/python benchmarks/serve_http.py --history 600 --traffic 2
    # H200, the real geometry (bash benchmarks/device.sh serve32)
    python3 benchmarks/serve_http.py --history 32768 --geometry glimmer-real \\
        --dtype bfloat16 --traffic 10 --json $OUT/serve32.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import _harness as H
import numpy as np

from muser_kv.serving.server.shutdown import LISTENING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' model writer, tokenizer and zoo

#: the chat template: every message's content; an assistant's after the
#: generation marker, so a prompt and its answer are the next prompt's prefix
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}t1 {% endif %}"
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t1{% endif %}")
SYSTEMS = ("muser", "mlx-lm")
NAMES = {"muser": "muser-kv serve", "mlx-lm": "mlx_lm.server"}
#: the requests whose answers are the same request's (turn 3's)
REPEATS = ("turn 3", "regenerate", "regenerate after restart")
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
#: muser-kv serve's warm-up line, before /health answers 200
WARM_UP = re.compile(r"muser-kv serve: warmed up in ([0-9.]+) s")
#: mlx-lm's prompt-cache statistics, logged with every request: not the request's path
QUIET = ("Prompt Cache:", "- ")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = H.parser(__doc__)
    p.add_argument("--history", type=H.one_int, default=32768,
                   help="tokens of the chat's third prompt (default 32768; at least 400)")
    p.add_argument("--traffic", type=int, default=10,
                   help="other users' chats served before regenerate, edit and branch (default 10)")
    p.add_argument("--answer", type=int, default=64, help="tokens per answer (default 64)")
    p.add_argument("--geometry", choices=("tiny", "glimmer-real"), default=None,
                   help="the model: the real Muse Glimmer, or --family at its tiny test geometry "
                        "(default: glimmer-real on a GPU, tiny otherwise)")
    p.add_argument("--family", default="muse_glimmer",
                   help="with --geometry tiny: a family of tests/model_zoo.ZOO (default "
                        "muse_glimmer)")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16",
                   help="the weights' dtype (default bfloat16)")
    p.add_argument("--max-context", type=int, default=None,
                   help="muser-kv serve's --max-context (default: --history plus room for a "
                        "turn, rounded up to 256)")
    p.add_argument("--systems", type=H.choice_list(*SYSTEMS), default=list(SYSTEMS),
                   help="the servers to drive, in order (default muser,mlx-lm)")
    p.add_argument("--model-dir", default=None,
                   help="where the model is written (reused if it holds a config.json; "
                        "default: a temporary directory)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may take (default 300)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds a server may take to answer /health (default 300)")
    p.add_argument("--fallback", type=int, default=2,
                   help="where mlx_lm.server fails a request, time mlx-lm's own prefill of "
                        "it in this process, for the first N it failed (default 2; 0: none)")
    p.add_argument("--logs", metavar="DIR", default=None,
                   help="copy the servers' logs into DIR (default: they stay in the run's "
                        "temporary directory, which is printed)")
    p.add_argument("--serve-flags", default="", metavar="FLAGS",
                   help="more flags for muser-kv serve, as one string (e.g. \"--retain 8\")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write all measurements as JSON")
    args = p.parse_args(argv)
    if args.history < 400:
        p.error(f"--history must be at least 400 (three turns and their answers), got "
                f"{args.history}")
    if args.geometry is None:
        args.geometry = "glimmer-real" if H.on_gpu() else "tiny"
    if args.max_context is None:
        args.max_context = -(-(args.history + 2 * args.answer + 256) // 256) * 256
    return args


# -- the model directory -------------------------------------------------------------------


def write_model(args: argparse.Namespace, directory: Path) -> Tuple[int, str]:
    """The model written into ``directory`` (unless it is already there): its
    vocabulary size, and a line describing it."""
    import mlx.core as mx
    from local_model import write_local_model

    config_path = directory / "config.json"
    if not config_path.exists():
        t = time.perf_counter()
        if args.geometry == "glimmer-real":
            from mlx_lm.models import muse_glimmer

            real = muse_glimmer.ModelArgs()
            fields = {k: getattr(real, k) for k in (
                "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "sliding_window",
                "max_position_embeddings")}
            write_local_model(directory, model_type="muse_glimmer", dtype=args.dtype,
                              seed=args.seed, **fields)
        else:
            from model_zoo import ZOO

            if args.family not in ZOO:
                raise SystemExit(f"--family must be one of {', '.join(sorted(ZOO))}, "
                                 f"got {args.family!r}")
            species = ZOO[args.family]
            fields = dict(species.args)
            if "max_position_embeddings" in fields:
                fields["max_position_embeddings"] = args.max_context
            write_local_model(directory, model_type=species.module, dtype=args.dtype,
                              seed=args.seed, quantize=species.quantize,
                              config_extra=species.config, **fields)
        settings_path = directory / "tokenizer_config.json"
        settings = json.loads(settings_path.read_text())
        settings["chat_template"] = CHAT_TEMPLATE
        settings_path.write_text(json.dumps(settings, indent=2))
        mx.clear_cache()
        print(f"wrote the model to {directory} in {time.perf_counter() - t:.1f} s")
    config = json.loads(config_path.read_text())
    text = config.get("text_config", config)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    line = (f"model: {config['model_type']}, {text.get('num_hidden_layers')} layers, hidden "
            f"{text.get('hidden_size')}, vocab {text['vocab_size']}, {args.dtype}, "
            f"{size / H.GB:.2f} GB of weights ({directory})")
    return int(text["vocab_size"]), line


# -- the chat --------------------------------------------------------------------------------


class Words:
    """Random words of the local tokenizer (``t2`` .. ``t{vocab-2}``: ``t0``
    and ``t1`` stay out, ``t1`` being the template's generation marker)."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def __call__(self, n: int) -> str:
        return " ".join(f"t{i}" for i in self.rng.integers(2, self.vocab - 1, n))


def plan(history: int, answer: int) -> Dict[str, int]:
    """The words of each message, so that turn 3's prompt has ``history``
    tokens (every message is its words, each assistant message and the
    generation prompt one marker more)."""
    second, third = min(200, history // 8), min(150, history // 10)
    system = min(2000, history // 4)
    first = history - system - second - third - 2 * answer - 3
    return {"system": system, "first": first, "second": second, "third": third}


# -- a server and the client -----------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One system's server in a subprocess on a free loopback port, its log in a
    file; ``stop`` ends it (terminate, then kill)."""

    def __init__(self, system: str, model: Path, log: Path, flags: Sequence[str]):
        # muser-kv serve binds any free port and names it (``shutdown.LISTENING``);
        # mlx_lm.server takes one picked here and says once it has bound it (``bound``)
        self.system, self.log_path = system, log
        self.port = 0 if system == "muser" else free_port()
        module = ["-m", "muser_kv", "serve"] if system == "muser" else ["-m", "mlx_lm.server"]
        self._start = len(log.read_text(errors="replace").splitlines()) if log.exists() else 0
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self._log = open(log, "a")
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, *module, "--model", str(model), "--host", "127.0.0.1", "--port",
             str(self.port), "--log-level", "INFO", *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))

    def lines(self) -> List[str]:
        self._log.flush()
        return self.log_path.read_text(errors="replace").splitlines()

    def last_line(self) -> str:
        lines = [x for x in self.lines() if x.strip()]
        return lines[-1] if lines else "(empty log)"

    def bound(self) -> bool:
        """Whether this server's own log says it listens on ``self.port`` (for
        muser-kv serve, the port it chose, read into ``self.port``)."""
        mine = "\n".join(self.lines()[self._start:])
        if self.system == "muser":
            found = LISTENING.search(mine)
            if found:
                self.port = int(found.group(1))
            return found is not None
        return f"Starting httpd at 127.0.0.1 on port {self.port}" in mine

    def wait_ready(self, timeout: float) -> Optional[str]:
        """``None`` once /health answers 200; else why not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited {self.proc.returncode}: {self.last_line()}"
            if not self.bound():  # until then another process may hold the port
                time.sleep(0.2)
                continue
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return None
            except OSError:
                pass
            time.sleep(0.2)
        return f"no answer to /health after {timeout:.0f} s: {self.last_line()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self._log.close()


@dataclass
class Streamed:
    """What one streamed chat completion gave: the HTTP status (None: no answer),
    an error, the perf-counter time of each chunk with content, the text, and
    the usage the last chunk carried."""

    status: Optional[int] = None
    error: Optional[str] = None
    chunks: List[float] = field(default_factory=list)
    text: List[str] = field(default_factory=list)
    usage: Dict[str, Any] = field(default_factory=dict)

    @property
    def answer(self) -> Optional[List[str]]:
        return "".join(self.text).split() if self.status == 200 and not self.error else None


def stream_completion(port: int, fields: Dict[str, Any], timeout: float) -> Streamed:
    """POST ``fields`` (a chat completion, streamed with its usage) and read the
    server-sent events to ``[DONE]``; a dead server or a broken stream is the
    request's error, not an exception."""
    body = json.dumps(dict(fields, stream=True, stream_options={"include_usage": True})).encode()
    out = Streamed()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        out.status = response.status
        if response.status != 200:
            out.error = response.read().decode(errors="replace")[:300]
        else:
            for raw in response:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        out.chunks.append(time.perf_counter())
                        out.text.append(content)
                out.usage = chunk.get("usage") or out.usage
        conn.close()
    except Exception as e:  # a dead server or a broken stream is this request's result
        out.error = f"{type(e).__name__}: {e}"
    return out


def stream_chat(server: Server, messages: List[Dict[str, str]], max_tokens: int,
                timeout: float) -> Dict[str, Any]:
    """One streaming chat completion at temperature 0: its status, TTFT (to the
    first chunk with content), the answer, the usage, and when it was sent and
    ended (wall clock, to place the server's log lines)."""
    sent = time.time()
    t0 = time.perf_counter()
    got = stream_completion(server.port, {"messages": messages, "max_tokens": max_tokens,
                                          "temperature": 0}, timeout)
    out: Dict[str, Any] = {
        "status": got.status, "error": got.error, "answer": got.answer,
        "ttft_s": got.chunks[0] - t0 if got.chunks else None,
        "prompt_tokens": got.usage.get("prompt_tokens"),
        "cached_tokens": (got.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "sent": sent, "ended": time.time(), "total_s": time.perf_counter() - t0}
    if out["status"] != 200 or out["error"]:
        out["error"] = (out["error"] or "") + f" | last log line: {server.last_line()}"
    return out


def log_window(server: Server, sent: float, ended: float) -> List[Tuple[float, str]]:
    """The server's log lines stamped inside ``[sent, ended]``, as (seconds after
    ``sent``, the message)."""
    out = []
    for line in server.lines():
        stamp, sep, rest = line.partition(" - ")
        if not sep:
            continue
        try:
            at = datetime.strptime(stamp, LOG_TIME).timestamp()
        except ValueError:
            continue
        message = rest.split(" - ", 1)[-1]
        if sent - 0.005 <= at <= ended + 0.005 and not message.startswith(QUIET):
            out.append((round(at - sent, 3), message))
    return out


def rebuilt(window: Sequence[Tuple[float, str]]) -> Optional[int]:
    for _, message in window:
        if "rebuilt" in message and "from the KV store" in message:
            return int(message.split("rebuilt ", 1)[1].split()[0])
    return None


def settle_store(store: Path, timeout: float = 120.0) -> None:
    """Wait until the store directory's bytes stop changing for 1.5 s (the
    server's write-behind has drained), at most ``timeout``."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        size = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) \
            if store.exists() else 0
        if size != last:
            last, since = size, time.monotonic()
        elif time.monotonic() - since > 1.5:
            return
        time.sleep(0.25)


# -- one system ----------------------------------------------------------------------------


def conversation(args: argparse.Namespace, vocab: int) -> Dict[str, Any]:
    """The chat's texts (answers are filled in as they come)."""
    words, n = Words(vocab, args.seed + 1), plan(args.history, args.answer)
    traffic_words = min(2048, args.history // 4)
    return {
        "system": words(n["system"]), "first": words(n["first"]), "second": words(n["second"]),
        "third": words(n["third"]), "edit": words(n["third"]), "branch": words(n["second"]),
        "traffic": [(words(traffic_words // 4), words(traffic_words - traffic_words // 4 - 1))
                    for _ in range(args.traffic)],
        "plan": n,
    }


def messages_of(chat: Dict[str, Any], answers: Dict[str, List[str]], request: str
                ) -> List[Dict[str, str]]:
    """The messages of one of the chat's requests, from the answers its system gave."""
    def turn(user: str, answer: Optional[str] = None) -> List[Dict[str, str]]:
        out = [{"role": "user", "content": user}]
        return out + ([{"role": "assistant", "content": answer}] if answer is not None else [])

    head = [{"role": "system", "content": chat["system"]}]
    a1, a2 = (" ".join(answers.get(k) or ["t2"]) for k in ("turn 1", "turn 2"))
    if request == "turn 1":
        return head + turn(chat["first"])
    if request == "turn 2":
        return head + turn(chat["first"], a1) + turn(chat["second"])
    if request == "branch":
        return head + turn(chat["first"], a1) + turn(chat["branch"])
    last = chat["edit"] if request == "edit" else chat["third"]
    return head + turn(chat["first"], a1) + turn(chat["second"], a2) + turn(last)


def run_system(system: str, args: argparse.Namespace, model: Path, work: Path,
               chat: Dict[str, Any], result: Dict[str, Any]) -> None:
    """Every request of the chat on one system, into ``result`` as they are
    answered (a run cut short keeps what it has); failures are results."""
    store = work / f"store-{system}"
    flags = ["--max-context", str(args.max_context), "--kv-store", str(store),
             *args.serve_flags.split()] if system == "muser" else []
    log = work / f"{system}.log"
    rows: List[Dict[str, Any]] = []
    answers: Dict[str, List[str]] = {}
    sent_messages: Dict[str, List[Dict[str, str]]] = {}
    result.update(system=NAMES[system], log=str(log), requests=rows, failure=None,
                  answers=answers)
    MESSAGES[system] = sent_messages

    def request(server: Server, name: str, messages: List[Dict[str, str]], max_tokens: int,
                keep: bool = True) -> Dict[str, Any]:
        r = stream_chat(server, messages, max_tokens, args.request_timeout)
        r["request"] = name
        sent_messages[name] = messages
        window = log_window(server, r.pop("sent"), r.pop("ended"))
        r["store_rebuilt"] = rebuilt(window)
        r["log"] = window
        if r["status"] == 200 and not r["error"]:
            answers[name] = r["answer"]
        if keep:
            rows.append(r)
        return r

    starts: List[Dict[str, Any]] = []
    result["starts"] = starts

    def start() -> Optional[Server]:
        server = Server(system, model, log, flags)
        why = server.wait_ready(args.start_timeout)
        if why is not None:
            result["failure"] = f"{NAMES[system]} did not start: {why}"
            server.stop()
            return None
        warm = [float(m.group(1)) for m in map(WARM_UP.search, server.lines()) if m]
        starts.append({"ready_s": round(time.time() - server.started, 3),
                       "warm_up_s": warm[-1] if warm else None})
        return server

    server = start()
    if server is None:
        return
    try:
        for name in ("turn 1", "turn 2", "turn 3"):
            request(server, name, messages_of(chat, answers, name), args.answer)
        traffic = [request(server, "traffic", [{"role": "system", "content": s},
                                               {"role": "user", "content": u}], 8, keep=False)
                   for s, u in chat["traffic"]]
        ok = [t["ttft_s"] for t in traffic if t["ttft_s"] is not None]
        result["traffic"] = {"requests": len(traffic), "answered": len(ok),
                             "median_ttft_s": H.median(ok) if ok else None,
                             "failures": sorted({f"{t['status']} {t['error']}"
                                                 for t in traffic if t["error"]})[:3]}
        request(server, "regenerate", messages_of(chat, answers, "turn 3"), args.answer)
        request(server, "edit", messages_of(chat, answers, "edit"), args.answer)
        request(server, "branch", messages_of(chat, answers, "branch"), args.answer)
        alive = server.proc.poll() is None
        server.stop()
        if system == "muser" and alive:
            settle_store(store)
        server = start()
        if server is None:
            return
        request(server, "regenerate after restart", messages_of(chat, answers, "turn 3"),
                args.answer)
    finally:
        if server is not None:
            server.stop()
    if system == "muser":  # a fresh server with no store: turn 3 from nothing
        flags = ["--max-context", str(args.max_context), "--kv-store-memory", "0",
                 *args.serve_flags.split()]
        fresh = start()
        if fresh is not None:
            try:
                result["fresh"] = request(fresh, "fresh server, turn 3",
                                          messages_of(chat, answers, "turn 3"), args.answer)
            finally:
                fresh.stop()


#: the messages each system was sent, per request (kept out of the JSON)
MESSAGES: Dict[str, Dict[str, List[Dict[str, str]]]] = {}


def in_process(args: argparse.Namespace, model: Path, result: Dict[str, Any]) -> None:
    """Where mlx_lm.server did not answer, mlx-lm's own prefill of the same
    request in this process (``mlx_lm.load``, the model's own caches,
    ``generate_step`` to its first token): the first ``--fallback`` requests it
    failed, each from empty caches. Errors are results."""
    failed = [r["request"] for r in result.get("requests", []) if r["ttft_s"] is None]
    if not result.get("requests") and result.get("failure"):
        failed = ["turn 1"]  # it did not start: the chat's first request, as muser-kv was sent it
    sent = {**MESSAGES.get("muser", {}), **MESSAGES.get("mlx-lm", {})}
    failed = [name for name in failed if name in sent][:args.fallback]
    if not failed:
        return
    out = result["in_process"] = []
    try:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        loaded, tokenizer = load(str(model))
    except Exception as e:
        out.append({"request": "load", "error": f"{type(e).__name__}: {e}"})
        return
    for name in failed:
        row: Dict[str, Any] = {"request": name, "error": None, "ttft_s": None}
        try:
            prompt = tokenizer.apply_chat_template(sent[name], add_generation_prompt=True)
            row["prompt_tokens"] = len(prompt)
            t = time.perf_counter()
            for token, _ in generate_step(mx.array(prompt), loaded, max_tokens=1):
                row["first_token"] = int(token)
            row["ttft_s"] = time.perf_counter() - t
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(row)
        mx.clear_cache()
    del loaded
    mx.clear_cache()


def print_fallback(result: Dict[str, Any]) -> None:
    for r in result.get("in_process", []):
        what = (f"TTFT {r['ttft_s']:.3f} s over {r.get('prompt_tokens')} prompt tokens"
                if r.get("ttft_s") is not None else f"failed: {r['error']}")
        print(f"- mlx_lm.server did not answer {r['request']}: mlx-lm's own prefill of the same "
              f"request in this process (its caches, generate_step, empty caches): {what}")
    print()


def identity(result: Dict[str, Any]) -> Dict[str, Any]:
    """Whether the system's answers to turn 3's request are one answer, and the
    fresh server's."""
    answers = result.get("answers", {})
    got = {k: answers.get(k) for k in REPEATS}
    first = got["turn 3"]
    fresh = (result.get("fresh") or {}).get("answer")
    return {
        "answered": {k: v is not None for k, v in got.items()},
        "repeats_identical": first is not None and all(v == first for v in got.values()),
        "equal_fresh": None if fresh is None else all(v == fresh for v in got.values()),
        "first_difference": {k: H.first_difference(first or [], v or [])
                             for k, v in got.items() if k != "turn 3"},
    }


def report(args: argparse.Namespace, results: Dict[str, Dict[str, Any]]) -> None:
    systems = list(results)
    if not systems:
        print("no system was started")
        return
    names = ["turn 1", "turn 2", "turn 3", "regenerate", "edit", "branch",
             "regenerate after restart"]
    names += [r["request"] for res in results.values() for r in res["requests"]]
    rows = []
    for name in dict.fromkeys(names):
        row: List[Any] = [name]
        for s in systems:
            r = next((x for x in results[s]["requests"] if x["request"] == name), None)
            if r is None:
                row += ["not run", "-"]
            elif r["ttft_s"] is None:
                row += [f"failed ({r['status']})", "-"]
            else:
                reused = r["cached_tokens"]
                extra = f", store {r['store_rebuilt']}" if r["store_rebuilt"] else ""
                row += [f"{r['ttft_s']:.3f}", f"{reused} / {r['prompt_tokens']}{extra}"]
        rows.append(row)
    columns = ["request"] + [c for s in systems for c in (f"{NAMES[s]} TTFT s",
                                                          f"{NAMES[s]} reused / prompt")]
    H.table(columns, rows, title="## Time to the first streamed content, per request",
            note="reused: the usage's cached_tokens; store: muser-kv's log line 'rebuilt N "
                 "tokens from the KV store'")
    for s in systems:
        res = results[s]
        if res.get("failure"):
            print(f"**{NAMES[s]} failed**: {res['failure']}\n")
        for r in res["requests"]:
            if r["error"]:
                print(f"- {NAMES[s]} {r['request']}: status {r['status']}: {r['error']}")
        ready = [f"{x['ready_s']:.1f} s" + (f" (warmed up in {x['warm_up_s']:.2f} s)"
                                             if x["warm_up_s"] is not None else "")
                 for x in res.get("starts", [])]
        if ready:
            print(f"- {NAMES[s]} ready (/health 200) after each start: {'; '.join(ready)}")
        t = res.get("traffic")
        if t:
            median = f"{t['median_ttft_s']:.3f} s" if t["median_ttft_s"] is not None else "-"
            print(f"- {NAMES[s]} traffic: {t['answered']} of {t['requests']} answered, median "
                  f"TTFT {median}" + (f"; failures: {t['failures']}" if t["failures"] else ""))
    print()
    if "muser" in results:
        print("## muser-kv serve's request path (its log, seconds after the request was sent)\n")
        for r in results["muser"]["requests"]:
            if r["request"] == "turn 1":
                continue
            ttft = f"{r['ttft_s']:.3f}" if r["ttft_s"] is not None else "-"
            steps = "; ".join(f"+{at:.3f} {msg[:200]}" for at, msg in r["log"][:10]) or "no lines"
            print(f"- {r['request']} (first content +{ttft}): {steps}")
        print()
        same = identity(results["muser"])
        results["muser"]["identity"] = same
        print("## muser-kv serve's answers to the same request (turn 3)\n")
        print(f"- answered: {same['answered']}")
        print(f"- turn 3, regenerate after the traffic, regenerate after the restart identical "
              f"token for token: {same['repeats_identical']} (first differing token: "
              f"{same['first_difference']})")
        print(f"- equal to a fresh server's answer (no store, a prefill from nothing): "
              f"{same['equal_fresh']}")
        print()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    # a SIGTERM (timeout's) unwinds: the servers are stopped, what was measured is reported
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="serve_http-"))
    model = Path(args.model_dir) if args.model_dir else work / "model"
    try:
        vocab, line = write_model(args, model)
        H.print_header("A returning chat through HTTP: muser-kv serve against mlx_lm.server",
                       args, line)
        chat = conversation(args, vocab)
        print(f"chat: {chat['plan']} words (answers {args.answer} tokens), turn 3's prompt "
              f"{args.history} tokens; {args.traffic} other chats of "
              f"{min(2048, args.history // 4)} tokens; logs in {work}\n")
        results: Dict[str, Dict[str, Any]] = {}
        try:
            for s in args.systems:
                results[s] = {}
                run_system(s, args, model, work, chat, results[s])
        finally:  # a run cut short (--timeout's SIGTERM) reports what it has
            report(args, {s: r for s, r in results.items() if "requests" in r})
            H.write_json(args.json, {"args": vars(args), "plan": chat["plan"],
                                     "results": results})
        if "mlx-lm" in results and args.fallback:  # after the report: a GPU's OOM may abort
            in_process(args, model, results["mlx-lm"])
            print_fallback(results["mlx-lm"])
            H.write_json(args.json, {"args": vars(args), "plan": chat["plan"],
                                     "results": results})
    finally:
        for store in work.glob("store-*"):
            shutil.rmtree(store, ignore_errors=True)
        if not args.model_dir:
            shutil.rmtree(model, ignore_errors=True)
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for log in work.glob("*.log"):
                shutil.copy(log, Path(args.logs) / f"serve_http_{log.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
