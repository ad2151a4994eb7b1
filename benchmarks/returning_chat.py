"""A returning chat on mlx-lm's server: time to first token, muser-kv against mlx-lm.

The question: a conversation with ~32k tokens of history comes back for its next
turn. How long until its first token, when the server runs muser-kv's caches and
prompt cache (``muser-kv serve``) against mlx-lm's server with its own caches?

The server's prompt-cache logic is driven in-process, call for call as
``mlx_lm/server.py`` 0.32.2 makes it (no HTTP, no tokenizer: token ids), on
mlx-lm's Muse Glimmer with random weights (real geometry by default: hidden
6656, 52 layers, vocab 202,048), both systems on the same model in one run:

* ``batched`` (the server's default path; ``_generate``): ``fetch_nearest_cache``,
  then ``BatchGenerator.insert_segments`` with the cache found, the cache at the
  end of the prompt's first segment (the prompt less its last token) extracted
  and inserted, the final cache inserted when the answer is done;
* ``sequential`` (``_serve_single``: a request with a seed, a draft model or
  images): ``fetch_nearest_cache``, mlx-lm's ``generate_step`` on what is left,
  the final cache inserted.

mlx-lm: ``model.make_cache()`` (``RotatingKVCache(2048)`` / ``KVCache``) and
mlx-lm's ``LRUPromptCache``. muser-kv: ``muser_kv.install(model)`` and
``ExactPromptCache``. Greedy, ``--answer`` tokens per turn (no stop tokens).

A conversation: a ``--history``-token first prompt (turn 0, cold: a full
prefill for both), then ``--repeats`` returning turns, each sending back the
whole history, the last answer less its last ``d`` tokens, and ``--user`` new
tokens. ``d`` is how far from its end the stored turn differs from what the
client sends back: 0 when it comes back token for token; a few tokens when the
client renders the model's end-of-turn or stop sequence its own way; many when
it re-renders the answer (a reasoning block stripped, a re-tokenized reply). A
client renders every turn alike, so each ``d`` of ``--divergences`` is a
conversation of its own, on a fresh server. mlx-lm's rotating caches, once
wrapped, cannot trim at all, so any ``d > 0`` falls back to the last stored
prefix (batched: the previous prompt less its last token; sequential: none, a
full re-prefill); muser-kv's trim exactly up to ``trimmable_depth()`` (at least
``--retain`` tokens past the wrap) and fall back the same way beyond it. The
table shows the median TTFT per cell, what the prompt cache supplied per turn,
and the ratio mlx-lm / muser-kv (above 1: muser-kv faster).

    python benchmarks/returning_chat.py                       # H200: 32k history, real geometry
    .venv/bin/python benchmarks/returning_chat.py --layers 4 --hidden 64 --intermediate 128 \\
        --vocab 512 --heads 4 --window 256 --max-position 4096 --history 2000 \\
        --user 16 --prefill-step 512                                      # CPU, reduced
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    DTYPES,
    int_list,
    median,
    now,
    print_header,
    print_table,
    ratio,
    settle,
    str_list,
    write_json,
)
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.models import muse_glimmer  # noqa: E402
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache  # noqa: E402

import muser_kv  # noqa: E402
from muser_kv.serving.prompt_cache import ExactPromptCache  # noqa: E402

SYSTEMS = ("mlx-lm", "muser-kv")
PATHS = ("batched", "sequential")
KEY = ("muse-glimmer", None, None)  # the server's model key: (model, adapter, draft)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", type=int, default=32768,
                   help="tokens of the first prompt (default 32768)")
    p.add_argument("--answer", type=int, default=160, help="tokens per answer (default 160)")
    p.add_argument("--user", type=int, default=32, help="new tokens per returning turn (default 32)")
    p.add_argument("--divergences", type=int_list, default=[0, 4, 150],
                   help="one conversation per d: answer tokens at the end of each stored turn the "
                        "client does not send back (default 0,4,150: 150 is past the depth a "
                        "ring with the default retain can trim; each < --answer)")
    p.add_argument("--repeats", type=int, default=2,
                   help="returning turns per conversation (default 2)")
    p.add_argument("--paths", type=str_list, default=list(PATHS),
                   help="server paths (default batched,sequential)")
    p.add_argument("--prefill-step", type=int, default=2048,
                   help="the server's --prefill-step-size (default 2048)")
    p.add_argument("--retain", type=int, default=muser_kv.DEFAULT_RETAIN,
                   help=f"muser-kv's --retain (default {muser_kv.DEFAULT_RETAIN})")
    p.add_argument("--max-context", type=int, default=None,
                   help="muser-kv's --max-context (default: the conversation's length rounded "
                        "up to 256, what a server for it would be given)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="model dtype (default bfloat16)")
    p.add_argument("--warmup", type=int, default=None,
                   help="an untimed conversation (one returning turn) per system and path first, "
                        "of this many history tokens (default window + 2 prefill steps; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE")
    g = p.add_argument_group("model geometry (defaults: the real Muse Glimmer)")
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--hidden", type=int, default=None)
    g.add_argument("--intermediate", type=int, default=None)
    g.add_argument("--vocab", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--window", type=int, default=None)
    g.add_argument("--max-position", type=int, default=None)
    args = p.parse_args(argv)
    for path in args.paths:
        if path not in PATHS:
            p.error(f"unknown path {path!r} (expected {', '.join(PATHS)})")
    if not all(0 <= d < args.answer for d in args.divergences):
        p.error(f"every divergence must be in [0, --answer) = [0, {args.answer})")
    if args.warmup is None:
        args.warmup = (args.window or muse_glimmer.ModelArgs().sliding_window) + 2 * args.prefill_step
    return args


def build_model(args: argparse.Namespace) -> muse_glimmer.Model:
    overrides = {"num_hidden_layers": args.layers, "hidden_size": args.hidden,
                 "intermediate_size": args.intermediate, "vocab_size": args.vocab,
                 "num_attention_heads": args.heads, "sliding_window": args.window,
                 "max_position_embeddings": args.max_position}
    model_args = muse_glimmer.ModelArgs(**{k: v for k, v in overrides.items() if v is not None})
    mx.random.seed(args.seed)
    model = muse_glimmer.Model(model_args)
    model.set_dtype(DTYPES[args.dtype])
    mx.eval(model.parameters())
    return model


class Server:
    """One system's server state for one path: its prompt cache (and, batched,
    its ``BatchGenerator``), served one request at a time as the server does."""

    def __init__(self, system: str, path: str, model, args: argparse.Namespace, max_context: int):
        self.system, self.path, self.model, self.args = system, path, model, args
        muser_kv.uninstall(model)
        if system == "muser-kv":
            muser_kv.install(model, max_context=max_context, retain=args.retain)
            self.lru: LRUPromptCache = ExactPromptCache()
        else:
            self.lru = LRUPromptCache()
        self.batch = (BatchGenerator(model, prefill_step_size=args.prefill_step)
                      if path == "batched" else None)

    def close(self) -> None:
        if self.batch is not None:
            self.batch.close()
        muser_kv.uninstall(self.model)

    def request(self, prompt: List[int]) -> Tuple[float, int, List[int]]:
        """(time to first token, prompt tokens reused, the answer)."""
        t0 = now()
        cache, rest = self.lru.fetch_nearest_cache(KEY, prompt)
        reused = len(prompt) - len(rest)
        if self.batch is None:
            return self._single(t0, prompt, cache, rest, reused)
        return self._batched(t0, prompt, cache, reused)

    def _single(self, t0, prompt, cache, rest, reused):
        if cache is None:
            cache = make_prompt_cache(self.model)
        gen = generate_step(mx.array(rest), self.model, prompt_cache=cache,
                            max_tokens=self.args.answer, prefill_step_size=self.args.prefill_step)
        answer = [int(next(gen)[0])]
        ttft = now() - t0
        answer += [int(t) for t, _ in gen]
        self.lru.insert_cache(KEY, prompt + answer, cache)
        return ttft, reused, answer

    def _batched(self, t0, prompt, cache, reused):
        bg = self.batch
        (uid,) = bg.insert_segments(segments=[[prompt[reused:]]], max_tokens=[self.args.answer],
                                    caches=[cache], all_tokens=[prompt[:reused]])
        del cache
        segment_types = ["assistant"]  # a text request's one segment (server.py _tokenize)
        ttft, answer = None, []
        while True:
            prompt_responses, gen_responses = bg.next()
            ends = [r.uid for r in prompt_responses
                    if r.end_of_segment and not r.end_of_prompt and segment_types]
            for _, (c, key) in bg.extract_cache(ends).items():
                self.lru.insert_cache(KEY, key[:], c, cache_type=segment_types.pop())
            for r in gen_responses:
                if ttft is None:
                    ttft = now() - t0
                answer.append(int(r.token))
                if r.finish_reason is not None:
                    self.lru.insert_cache(KEY, r.all_tokens[:], r.prompt_cache,
                                          cache_type="assistant")
                    return ttft, reused, answer


def conversation(server: Server, history: List[int], users: List[List[int]],
                 d: int) -> List[Dict[str, Any]]:
    """Turn 0 (``history``), then ``len(users)`` returning turns, each sending
    back the last answer less its last ``d`` tokens (a client renders every
    turn the same way, so ``d`` is one per conversation)."""
    out = []
    prompt = list(history)
    for turn in range(len(users) + 1):
        if turn:
            prompt = prompt + answer[:len(answer) - d] + users[turn - 1]
        ttft, reused, answer = server.request(prompt)
        out.append({"turn": turn, "d": d, "prompt": len(prompt), "ttft_s": ttft,
                    "reused": reused, "answer": answer})
    return out


def _reuse(turns: List[Dict[str, Any]]) -> str:
    """What the prompt cache supplied, as ``reused / prompt`` per turn."""
    return ", ".join(f"{r['reused']:,}/{r['prompt']:,}" for r in turns)


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    length = args.history + args.repeats * (args.answer + args.user) + args.answer
    max_context = args.max_context or -(-length // 256) * 256
    print_header("returning chat: time to first token on mlx-lm's server, muser-kv vs mlx-lm",
                 args, extra=f"conversations up to {length:,} tokens; muser-kv max_context "
                             f"{max_context:,}")
    t = now()
    model = build_model(args)
    vocab = model.args.vocab_size
    print(f"model: {model.args.num_hidden_layers} layers, hidden {model.args.hidden_size}, vocab "
          f"{vocab}, window {model.args.sliding_window}, {args.dtype}; built in {now() - t:.1f} s")
    if max_context > model.args.max_position_embeddings:
        raise SystemExit(f"the conversation needs max_context {max_context:,}, past the model's "
                         f"max_position_embeddings {model.args.max_position_embeddings:,}")
    rng = np.random.default_rng(args.seed)
    history = [int(x) for x in rng.integers(0, vocab, args.history)]
    users = [[int(x) for x in rng.integers(0, vocab, args.user)] for _ in range(args.repeats)]
    warm = [int(x) for x in rng.integers(0, vocab, args.warmup)]
    results: List[Dict[str, Any]] = []
    order = 0
    for path in args.paths:
        if args.warmup:  # both systems' prefill, reuse, trim and decode compiled before timing
            d = min([d for d in args.divergences if d > 0] or [0])
            for system in SYSTEMS:
                server = Server(system, path, model, args, max_context)
                conversation(server, warm, users[:1], d)
                server.close()
                del server
                settle()
        for d in dict.fromkeys(args.divergences):
            for system in (SYSTEMS if order % 2 == 0 else SYSTEMS[::-1]):
                server = Server(system, path, model, args, max_context)
                t = now()
                for turn in conversation(server, history, users, d):
                    results.append({"system": system, "path": path, **turn})
                print(f"{path}, d = {d}, {system}: {args.repeats + 1} turns in {now() - t:.1f} s",
                      flush=True)
                server.close()
                del server
                settle()
            order += 1
    rows, checks = [], []
    for path in args.paths:
        mine = [r for r in results if r["path"] == path]
        cells = [("cold (turn 0)", lambda r: r["turn"] == 0)] + [
            (d, lambda r, d=d: r["turn"] > 0 and r["d"] == d) for d in dict.fromkeys(args.divergences)]
        for label, pick in cells:
            theirs = [r for r in mine if r["system"] == "mlx-lm" and pick(r)]
            ours = [r for r in mine if r["system"] == "muser-kv" and pick(r)]
            t_mlx, t_ours = median([r["ttft_s"] for r in theirs]), median([r["ttft_s"] for r in ours])
            rows.append([path, label, f"{theirs[0]['prompt']:,}-{theirs[-1]['prompt']:,}", t_mlx,
                         t_ours, ratio(t_mlx, t_ours), _reuse(theirs), _reuse(ours)])
        first = {s: next(r for r in mine if r["system"] == s) for s in SYSTEMS}
        checks.append([path, first_difference(first["mlx-lm"]["answer"],
                                              first["muser-kv"]["answer"])])
    print()
    print_table(["path", "d", "prompt tokens", "TTFT mlx-lm s", "TTFT muser-kv s",
                 "mlx-lm / muser-kv", "reused / prompt, mlx-lm", "reused / prompt, muser-kv"],
                rows, digits=3)
    print("d: answer tokens at the end of the stored turn the client does not send back; "
          "reused: prompt tokens the prompt cache supplied, per turn; TTFT: the median, from the "
          "prompt-cache lookup to the first token (cold: one turn 0 per d)")
    print()
    print_table(["path", "turn 0 answers: first differing token"], checks)
    print("(greedy answers of a fresh prefill through both systems' caches; with random weights "
          "near-ties make equality a weak signal, so it is reported, not asserted)")
    payload = {"benchmark": "returning_chat", "args": vars(args), "max_context": max_context,
               "results": results}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
