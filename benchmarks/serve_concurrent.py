"""Many chats at once through HTTP: does `muser-kv serve` stream at engine speed?

Against `mlx_lm.server` and mlx-lm's in-process `BatchGenerator`.

The model is written as ``serve_http.py`` writes it (``--geometry``,
``--dtype``, ``--model-dir``; the tests' word-level tokenizer, one word one
token). Each system of ``--systems`` is started in turn (a free loopback port,
its log kept) and driven by plain HTTP clients, one thread each; every request
is a streaming chat completion at temperature 0 of at most ``--answer``
tokens.

``--scenario mixed`` (for each N of ``--clients``): N chats whose prompts are
spread evenly from ``--min-history`` to ``--history`` tokens, every other one
opening with the same system message (``--system`` tokens), sent
``--stagger`` seconds apart, so that requests join a running batch and leave
it. Per request: TTFT (to the first streamed chunk with content) and the
median gap between its streamed chunks after the first; per run: the streamed
tokens per second over the run (all answers' tokens over the time from the
first request sent to the last answer's end). Beside them, ``reference``:
mlx-lm's ``BatchGenerator`` in this process, with muser-kv's caches
(``muser_kv.install``, head-major rings as serve's default), over the same
prompts arriving at the same offsets: its tokens per second, and its median
decode step (a step that prefilled nothing). Ratios: muser-kv against the
reference and against mlx_lm.server. ``--check-alone``: afterwards every
request is sent again, one at a time, to a fresh muser-kv server, and its
answer must equal the one under load (temperature 0), else the run exits 1; a
request muser-kv fails exits 1 too.

``--scenario prefill``: one chat streams a ``--answer``-token answer; after
``--stagger`` seconds another client sends a ``--history``-token prompt
(answered with 8 tokens). Printed: the running chat's median gap before the
long prompt arrived (alone) and while it prefilled (from its send to its first
token), and the long prompt's TTFT against an equally long other prompt's
TTFT sent alone first. The window from the long prompt's send to its first
token opens with its way to the generation thread (the running chat's gaps
there are the ones alone), so the longest gap in it says most about the
prefill's chunks. ``--serve-flags`` (e.g. ``"--prefill-budget 256"``)
is how budgets are compared.

``--scenario reads`` (in this process, no HTTP): for each N of ``--clients``,
N prompts of ``--min-history`` tokens decoded ``--answer`` steps by mlx-lm's
``BatchGenerator`` and by serve's ``ServeBatchGenerator`` (both over
muser-kv's caches), every token's log-probability read as mlx-lm's server
reads it (``r.logprobs[r.token].item()``): the median time inside that read
and the decode steps per second.

    # CPU, the CI test's size (well under a minute on two cores)
    PYTHONPATH=. .venv/bin/python benchmarks/serve_concurrent.py --geometry tiny \\
        --clients 4 --history 240 --min-history 40 --answer 24 --stagger 0.05 --check-alone
    # GPU (bash benchmarks/device.sh concurrent)
    python3 benchmarks/serve_concurrent.py --history 32768 --clients 4,8,16 --json $OUT/c.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import _harness as H
import serve_http as S

SYSTEMS = S.SYSTEMS
NAMES = S.NAMES


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = H.parser(__doc__)
    p.add_argument("--scenario", choices=("mixed", "prefill", "reads"), default="mixed")
    p.add_argument("--clients", type=H.int_list, default=[4, 8, 16],
                   help="concurrent chats per run, a comma list (default 4,8,16; mixed only)")
    p.add_argument("--history", type=H.one_int, default=32768,
                   help="the longest prompt, in tokens (default 32768)")
    p.add_argument("--min-history", type=H.one_int, default=2048,
                   help="the shortest prompt, in tokens (default 2048; mixed only)")
    p.add_argument("--system", type=int, default=None,
                   help="tokens of the system message every other chat shares (default: a "
                        "quarter of --min-history)")
    p.add_argument("--answer", type=int, default=128, help="tokens per answer (default 128)")
    p.add_argument("--stagger", type=float, default=0.5,
                   help="seconds between two requests' arrivals (default 0.5)")
    p.add_argument("--geometry", choices=("tiny", "glimmer-real"), default=None,
                   help="as serve_http.py (default: glimmer-real on a GPU, tiny otherwise)")
    p.add_argument("--family", default="muse_glimmer")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16")
    p.add_argument("--max-context", type=int, default=None,
                   help="muser-kv serve's --max-context (default: --history plus the answer, "
                        "rounded up to 256)")
    p.add_argument("--systems", type=H.choice_list(*SYSTEMS, "reference"),
                   default=[*SYSTEMS, "reference"],
                   help="what to run, in order (default muser,mlx-lm,reference)")
    p.add_argument("--check-alone", action="store_true",
                   help="send every request again, one at a time, to a fresh muser-kv server; "
                        "its answer must equal the one under load (exit 1 otherwise)")
    p.add_argument("--no-eos", action="store_true",
                   help="every request's logit_bias keeps the end token out (the in-process "
                        "reference's logits processor likewise), so every answer has --answer "
                        "tokens: for a tiny random model, whose small vocabulary ends answers "
                        "early")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--logs", metavar="DIR", default=None, help="copy the servers' logs into DIR")
    p.add_argument("--serve-flags", default="", metavar="FLAGS",
                   help="more flags for muser-kv serve, as one string")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write all measurements as JSON")
    args = p.parse_args(argv)
    if args.geometry is None:
        args.geometry = "glimmer-real" if H.on_gpu() else "tiny"
    if args.system is None:
        args.system = max(1, args.min_history // 4)
    if args.scenario == "prefill":
        args.clients = [2]
    if args.max_context is None:
        args.max_context = -(-(args.history + args.answer + 256) // 256) * 256
    return args


# -- the requests ----------------------------------------------------------------------------


def chats(args: argparse.Namespace, vocab: int, n: int, salt: int = 0) -> List[Dict[str, Any]]:
    """``n`` chats, prompts spread from ``--min-history`` to ``--history``
    tokens, every other one opening with the shared system message; each with
    its arrival offset in seconds."""
    words = S.Words(vocab, args.seed + 1000 * salt + n)
    shared = words(args.system)
    out = []
    for i in range(n):
        length = args.history if n == 1 else round(
            args.min_history + (args.history - args.min_history) * i / (n - 1))
        messages = []
        if i % 2 == 0 and length > args.system + 8:
            messages.append({"role": "system", "content": shared})
            length -= args.system
        messages.append({"role": "user", "content": words(max(1, length - 2))})
        out.append({"name": f"chat {i} ({length if i % 2 else length + args.system} tokens)",
                    "messages": messages, "at": i * args.stagger, "max_tokens": args.answer,
                    "bias": {str(vocab - 1): -1000.0} if args.no_eos else None})
    return out


def stream(port: int, chat: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """One streaming chat completion at temperature 0: its status, the
    perf-counter time of every chunk with content, the answer, the usage."""
    fields = {"messages": chat["messages"], "max_tokens": chat["max_tokens"], "temperature": 0}
    if chat.get("bias"):
        fields["logit_bias"] = chat["bias"]
    t0 = time.perf_counter()
    got = S.stream_completion(port, fields, timeout)
    gaps = [b - a for a, b in zip(got.chunks, got.chunks[1:])]
    return {"request": chat["name"], "status": got.status, "error": got.error,
            "answer": got.answer, "chunks": got.chunks,
            "completion_tokens": got.usage.get("completion_tokens"), "sent": t0,
            "ended": time.perf_counter(), "ttft_s": got.chunks[0] - t0 if got.chunks else None,
            "median_gap_ms": statistics.median(gaps) * 1e3 if gaps else None}


def drive(port: int, requests: List[Dict[str, Any]], timeout: float) -> Dict[str, Any]:
    """Every request on its own thread, each sent at its offset; the rows in
    request order, and the run's streamed tokens per second."""
    rows: List[Optional[Dict[str, Any]]] = [None] * len(requests)
    start = time.perf_counter()

    def one(i: int) -> None:
        time.sleep(max(0.0, start + requests[i]["at"] - time.perf_counter()))
        rows[i] = stream(port, requests[i], timeout)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + requests[-1]["at"] + 10)
    done = [r if r is not None else {"request": q["name"], "error": "no answer in time",
                                      "status": None, "answer": None, "chunks": [],
                                      "ttft_s": None, "median_gap_ms": None}
            for r, q in zip(rows, requests)]
    return summary(done, start)


def summary(rows: List[Dict[str, Any]], start: float) -> Dict[str, Any]:
    tokens = sum(len(r["answer"] or []) for r in rows)
    end = max([r.get("ended", start) for r in rows] + [start])
    failed = [r["request"] for r in rows if r["status"] != 200 or r["error"] or not r["answer"]]
    for r in rows:
        r["times"] = [round(t - start, 5) for t in r.pop("chunks", [])]
        for key in ("sent", "ended"):
            if key in r:
                r[key] = round(r[key] - start, 4)
    return {"requests": rows, "tokens": tokens, "seconds": end - start,
            "tok_s": tokens / (end - start) if end > start else None, "failed": failed}


# -- the systems ------------------------------------------------------------------------------


def served(system: str, args: argparse.Namespace, model: Path, work: Path, tag: str,
           body: Any) -> Dict[str, Any]:
    """Start ``system``'s server, run ``body(port)`` against it, stop it; a server
    that does not start is the result's ``failure``."""
    flags = (["--max-context", str(args.max_context), *args.serve_flags.split()]
             if system == "muser" else [])
    log = work / f"{system}-{tag}.log"
    server = S.Server(system, model, log, flags)
    try:
        why = server.wait_ready(args.start_timeout)
        if why is not None:
            return {"system": NAMES[system], "failure": f"did not start: {why}", "log": str(log)}
        out = body(server.port)
        out.update(system=NAMES[system], failure=None, log=str(log))
        return out
    finally:
        server.stop()


def reference(args: argparse.Namespace, model_dir: Path, requests: List[Dict[str, Any]]
              ) -> Dict[str, Any]:
    """mlx-lm's ``BatchGenerator`` in this process with muser-kv's caches, the
    same prompts inserted at the same offsets (between its steps): tokens per
    second over the run, and its median decode step (one that prefilled nothing)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors

    import muser_kv

    model, tokenizer = load(str(model_dir))
    muser_kv.install(model, max_context=args.max_context, sliding_layout="head_major")
    prompts = [tokenizer.apply_chat_template(q["messages"], add_generation_prompt=True)
               for q in requests]
    gen = BatchGenerator(model, max_tokens=args.answer, completion_batch_size=32,
                         prefill_batch_size=8)
    uids: Dict[int, int] = {}
    answers: Dict[int, List[int]] = {}
    steps: List[float] = []
    start = time.perf_counter()
    pending = list(range(len(requests)))
    finished = 0
    while finished < len(requests):
        now = time.perf_counter() - start
        while pending and requests[pending[0]]["at"] <= now:
            i = pending.pop(0)
            bias = requests[i].get("bias")
            processors = [make_logits_processors(
                logit_bias={int(k): v for k, v in bias.items()})] if bias else None
            (uid,) = gen.insert([prompts[i]], [requests[i]["max_tokens"]],
                                logits_processors=processors)
            uids[uid] = i
            answers[i] = []
        if not uids or (finished == len(uids) and pending):
            time.sleep(0.001)
            continue
        t = time.perf_counter()
        prompt_responses, responses = gen.next()
        if responses and not prompt_responses:
            steps.append(time.perf_counter() - t)
        for r in responses:
            answers[uids[r.uid]].append(r.token)
            if r.finish_reason is not None:
                finished += 1
    seconds = time.perf_counter() - start
    gen.close()
    tokens = sum(len(a) for a in answers.values())
    del model
    mx.clear_cache()
    return {"system": "BatchGenerator in-process (muser-kv caches)", "failure": None,
            "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "step_ms": statistics.median(steps) * 1e3 if steps else None, "failed": []}


def reads(args: argparse.Namespace, model_dir: Path, work: Path, vocab: int) -> Dict[str, Any]:
    """The server's per-token log-probability read, timed, under mlx-lm's
    ``BatchGenerator`` and serve's ``ServeBatchGenerator``."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    import muser_kv
    from muser_kv.serving.server.scheduler import ServeBatchGenerator

    model, _ = load(str(model_dir))
    muser_kv.install(model, max_context=args.max_context, sliding_layout="head_major")
    words = S.Words(vocab, args.seed)
    out: Dict[str, Any] = {}
    for n in args.clients:
        prompts = [[int(w[1:]) for w in words(args.min_history).split()] for _ in range(n)]
        row: Dict[str, Any] = {}
        for name, cls in (("BatchGenerator", BatchGenerator), ("ServeBatchGenerator",
                                                               ServeBatchGenerator)):
            gen = cls(model, max_tokens=args.answer, completion_batch_size=max(32, n),
                      prefill_batch_size=n)
            gen.insert(prompts, [args.answer] * n)
            inside: List[float] = []
            tokens, start = 0, None
            while True:
                _, responses = gen.next()
                if responses and start is None:
                    start = time.perf_counter()  # decode from here: the prefill is done
                for r in responses:
                    t = time.perf_counter()
                    r.logprobs[r.token].item()
                    inside.append(time.perf_counter() - t)
                    tokens += 1
                if tokens >= n * args.answer:
                    break
            seconds = time.perf_counter() - (start or time.perf_counter())
            gen.close()
            row[name] = {"read_ms": statistics.median(inside) * 1e3,
                         "steps_s": args.answer / seconds if seconds else None}
            mx.clear_cache()
        out[f"N={n}"] = row
        print(f"N={n}: " + "; ".join(
            f"{k}: read {v['read_ms']:.3f} ms median, {fmt(v['steps_s'])} steps/s"
            for k, v in row.items()))
    return out


def mixed(args: argparse.Namespace, model: Path, work: Path, vocab: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for n in args.clients:
        requests = chats(args, vocab, n)
        run: Dict[str, Any] = {}
        print(f"\n{n} concurrent chats", flush=True)
        for system in args.systems:
            if system == "reference":
                run[system] = reference(args, model, requests)
                print_system(run[system])
                continue

            def body(port: int, requests: List[Dict[str, Any]] = requests) -> Dict[str, Any]:
                return drive(port, requests, args.request_timeout)

            def alone(port: int, requests: List[Dict[str, Any]] = requests) -> Dict[str, Any]:
                return {"answers": [stream(port, q, args.request_timeout)["answer"]
                                    for q in requests]}
            run[system] = served(system, args, model, work, f"mixed{n}", body)
            if args.check_alone and system == "muser" and not run[system]["failure"]:
                # a fresh server, one request at a time: nothing reused from the run
                run[system]["alone"] = served(system, args, model, work, f"alone{n}",
                                              alone).get("answers")
            print_system(run[system])
        out[f"N={n}"] = run
        print_ratios(run)
    return out


def prefill(args: argparse.Namespace, model: Path, work: Path, vocab: int) -> Dict[str, Any]:
    chat = chats(argparse.Namespace(**{**vars(args), "history": args.min_history}), vocab, 1, 1)[0]
    longs = [chats(args, vocab, 1, salt)[0] for salt in (2, 3)]
    for q in longs:
        q["max_tokens"] = 8
    run: Dict[str, Any] = {}
    for system in [s for s in args.systems if s != "reference"]:
        def body(port: int) -> Dict[str, Any]:
            alone = stream(port, longs[0], args.request_timeout)
            requests = [chat, {**longs[1], "at": args.stagger}]
            loaded = drive(port, requests, args.request_timeout)
            return {"long_alone": alone, **loaded}
        run[system] = served(system, args, model, work, "prefill", body)
    print_prefill(run)
    return run


# -- the report -------------------------------------------------------------------------------


def fmt(x: Optional[float], spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_system(r: Dict[str, Any]) -> None:
    """One system's run, as soon as it is done (a run cut short keeps it)."""
    if r.get("failure"):
        print(f"  {r['system']}: {r['failure']}", flush=True)
        return
    extra = f", median decode step {fmt(r.get('step_ms'), '.2f')} ms" if "step_ms" in r else ""
    print(f"  {r['system']}: {r['tokens']} tokens in {r['seconds']:.2f} s, "
          f"{fmt(r['tok_s'])} tok/s{extra}; failed: {len(r['failed'])}")
    for q in r.get("requests", []):
        print(f"    {q['request']:>22}: TTFT {fmt(q['ttft_s'], '.3f')} s, median gap "
              f"{fmt(q['median_gap_ms'], '.2f')} ms, {len(q['answer'] or [])} tokens"
              + (f"  ERROR {q['error']}" if q.get("error") else ""))
    if "alone" in r:
        same = [q["answer"] == a for q, a in zip(r["requests"], r["alone"] or [])]
        print(f"    answers under load equal the same requests alone: {sum(same)}/{len(same)}")
    sys.stdout.flush()


def print_ratios(run: Dict[str, Any]) -> None:
    ours, theirs, ref = (run.get(k, {}).get("tok_s") for k in ("muser", "mlx-lm", "reference"))
    if ours and ref:
        print(f"  muser-kv serve / in-process BatchGenerator: {ours / ref:.2f}x")
    if ours and theirs:
        print(f"  muser-kv serve / mlx_lm.server: {ours / theirs:.2f}x")
    step = run.get("reference", {}).get("step_ms")
    if step and run.get("muser", {}).get("requests"):
        worst = max((q["median_gap_ms"] or 0) for q in run["muser"]["requests"])
        print(f"  muser-kv serve's worst median gap / the reference's decode step: "
              f"{worst / step:.2f}x")


def print_prefill(run: Dict[str, Any]) -> None:
    print("\na running chat while another client's long prompt prefills")
    for r in run.values():
        if r.get("failure"):
            print(f"  {r['system']}: {r['failure']}")
            continue
        chat, long = r["requests"]
        alone = r["long_alone"]
        print(f"  {r['system']}: {chat_gaps(chat, long)}; the long prompt's TTFT "
              f"{fmt(long['ttft_s'], '.3f')} s beside it, {fmt(alone['ttft_s'], '.3f')} s alone"
              + (f" ({long['ttft_s'] / alone['ttft_s']:.2f}x)"
                 if long["ttft_s"] and alone["ttft_s"] else "")
              + (f"; failed: {r['failed']}" if r["failed"] else ""))


def chat_gaps(chat: Dict[str, Any], long: Dict[str, Any]) -> str:
    """The running chat's median gap before the long prompt was sent and while it
    prefilled (from its chunks' ``times``, seconds into the run as ``sent``)."""
    times = chat.get("times") or []
    if len(times) < 3 or long.get("ttft_s") is None:
        return "the running chat's gaps: too few tokens"
    sent, first = long["sent"], long["sent"] + long["ttft_s"]
    gaps = [(b, b - a) for a, b in zip(times, times[1:])]
    before = [g for t, g in gaps if t < sent]
    during = [g for t, g in gaps if sent <= t <= first]
    b = statistics.median(before) * 1e3 if before else None
    d = statistics.median(during) * 1e3 if during else None
    worst = max(during) * 1e3 if during else None
    ratio = f" ({d / b:.2f}x)" if b and d else ""
    return (f"the running chat's median gap {fmt(b, '.2f')} ms alone, {fmt(d, '.2f')} ms while "
            f"the long prompt prefilled{ratio}, longest then {fmt(worst, '.0f')} ms "
            f"({len(during)} tokens then)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="serve-concurrent-"))
    model = Path(args.model_dir) if args.model_dir else work / "model"
    model.mkdir(parents=True, exist_ok=True)
    vocab, line = S.write_model(args, model)
    print(line)
    print(f"work directory: {work}")
    scenario = {"mixed": mixed, "prefill": prefill, "reads": reads}[args.scenario]
    results = scenario(args, model, work, vocab)
    if args.logs:
        import shutil

        Path(args.logs).mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            shutil.copy(log, Path(args.logs) / log.name)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=1, default=str))
    bad = []
    runs = {"mixed": results.items(), "prefill": [("prefill", results)], "reads": []}
    for key, run in runs[args.scenario]:
        for system, r in run.items():
            if system == "muser" and (r.get("failure") or r.get("failed")):
                bad.append(f"{key} {r['system']}: {r.get('failure') or r.get('failed')}")
            if "alone" in r and (r["alone"] is None or any(
                    q["answer"] != a for q, a in zip(r["requests"], r["alone"]))):
                bad.append(f"{key}: an answer under load differs from the same request alone")
    for b in bad:
        print(f"FAILED: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
