"""A chat with ~32k tokens of history returns: how soon is its first token, muser-kv's server against mlx-lm's?

mlx-lm's server prompt-cache logic is driven in-process, call for call as
``mlx_lm/server.py`` 0.32.2 makes it (no HTTP, no tokenizer: token ids), on one
Muse Glimmer (``_harness.build_model``) or, with ``--family gemma3-27b`` or
``gpt-oss-20b``, that checkpoint's shapes with random weights
(``_harness.FAMILIES``; ``--family-override key=value,...`` puts ModelArgs
fields in place of the family's: a smaller model of the same code, for a CPU
check; a smaller ``num_hidden_layers`` keeps the family's first ``layer_types``),
with muser-kv's caches and
``ExactPromptCache`` (``muser_kv.install(model)``: ``muser-kv serve``) against
mlx-lm's (``model.make_cache()``) and ``LRUPromptCache``; greedy, ``--answer``
tokens per turn, on both server paths:

* ``batched`` (the default; ``_generate``): ``fetch_nearest_cache``, then
  ``BatchGenerator.insert_segments`` with the cache found, the cache at the end
  of the prompt's first segment (the prompt less its last token) extracted and
  inserted, the final cache inserted when the answer is done;
* ``sequential`` (``_serve_single``: a request with a seed, a draft model or
  images): ``fetch_nearest_cache``, ``generate_step`` on the rest, the final
  cache inserted.

A conversation: a ``--history``-token first prompt (turn 0, cold: a full
prefill), then ``--repeats`` returning turns, each sending back the whole
history, the last answer less its last ``d`` tokens, and ``--user`` new tokens.
``d`` is how far from its end the stored turn differs from what the client sends
back: 0 token for token; a few when the client renders the end-of-turn or stop
sequence its own way; many when it re-renders the answer (a reasoning block
stripped, a reply re-tokenized). Each ``d`` of ``--divergences`` is a
conversation of its own on a fresh server, the systems' order flipped every
conversation. mlx-lm's rotating caches, once wrapped, cannot trim, so any
``d > 0`` falls back to the last stored prefix (batched: the previous prompt
less its last token; sequential: none, a full re-prefill); muser-kv's trim
exactly up to ``trimmable_depth()`` (at least ``--retain`` tokens past the wrap)
and fall back the same way beyond it. Printed: the median TTFT per cell, what
the prompt cache supplied per turn, mlx-lm / muser-kv (above 1: muser-kv faster).

    bash benchmarks/device.sh returning                         # H200: 32k history, real geometry
    python3 benchmarks/returning_chat.py --family gemma3-27b --divergences 0,4,150    # H200
    python3 benchmarks/returning_chat.py --family gpt-oss-20b --divergences 0,4,150   # H200
    PYTHONPATH=. .venv/bin/python benchmarks/returning_chat.py --layers 4 --hidden 64 \\
        --intermediate 128 --vocab 512 --heads 4 --window 128 --max-position 4096 \\
        --history 600 --answer 24 --divergences 0,4,20 --user 16 --prefill-step 256   # CPU
    PYTHONPATH=. .venv/bin/python benchmarks/returning_chat.py --family gemma3-27b \\
        --family-override hidden_size=64,intermediate_size=128,num_hidden_layers=6 \\
        --family-override num_attention_heads=4,num_key_value_heads=2,head_dim=16 \\
        --family-override query_pre_attn_scalar=16,sliding_window=64,vocab_size=512 \\
        --family-override max_position_embeddings=4096 --history 400 --answer 160 \\
        --divergences 0,4,150 --user 16 --repeats 1 --prefill-step 128      # CPU smoke check
    PYTHONPATH=. .venv/bin/python benchmarks/returning_chat.py --family gpt-oss-20b \\
        --dtype float32 --family-override hidden_size=64,intermediate_size=64 \\
        --family-override num_hidden_layers=4,num_local_experts=4,num_experts_per_tok=2 \\
        --family-override num_attention_heads=4,num_key_value_heads=2,head_dim=16 \\
        --family-override sliding_window=64,vocab_size=512 --history 400 --answer 160 \\
        --divergences 0,4,150 --user 16 --repeats 1 --prefill-step 128      # CPU smoke check

(GPT-OSS on the CPU in float32: MLX's CPU ``gather_mm``, which its experts run,
takes f32 only.)
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import _harness as H
import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

import muser_kv
from muser_kv.serving.server.prompt_cache import ExactPromptCache

PATHS = ("batched", "sequential")
GLIMMER = "muse-glimmer"


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--history", type=int, default=32768,
                   help="tokens of the first prompt (default 32768)")
    p.add_argument("--answer", type=int, default=160, help="tokens per answer (default 160)")
    p.add_argument("--user", type=int, default=32, help="new tokens per returning turn (default 32)")
    p.add_argument("--divergences", type=H.int_list, default=[0, 4, 150],
                   help="one conversation per d: answer tokens at the end of each stored turn the "
                        "client does not send back (default 0,4,150: 150 is past the depth a "
                        "ring with the default retain can trim; each < --answer)")
    p.add_argument("--paths", type=H.choice_list(*PATHS), default=list(PATHS),
                   help="server paths (default batched,sequential)")
    p.add_argument("--retain", type=int, default=muser_kv.DEFAULT_RETAIN,
                   help=f"muser-kv's --retain (default {muser_kv.DEFAULT_RETAIN})")
    p.add_argument("--max-context", type=int, default=None,
                   help="muser-kv's --max-context (default: the conversation's length rounded "
                        "up to 256, what a server for it would be given)")
    p.add_argument("--family", choices=[GLIMMER, *H.FAMILIES], default=GLIMMER,
                   help="the model: Muse Glimmer at the geometry flags (default), or a family at "
                        "its real checkpoint's shapes (the geometry flags then unused)")
    p.add_argument("--family-override", type=H.overrides, action="append", default=[],
                   metavar="KEY=VALUE,...",
                   help="ModelArgs fields in place of the family's (values read as JSON where "
                        "they parse), e.g. hidden_size=64,num_hidden_layers=4; may be repeated")
    H.add_prefill_flags(p)  # the warm-up: a conversation, one returning turn, per system and path
    H.add_flags(p, dtype="bfloat16", blocks=("repeats", 2, "returning turns per conversation"))
    warmup_given = p.parse_args(argv).warmup is not None
    args = H.parse(p, argv)
    args.family_override = {k: v for part in args.family_override for k, v in part.items()}
    if args.family_override and args.family == GLIMMER:
        p.error("--family-override needs --family (Muse Glimmer takes the geometry flags)")
    if args.family != GLIMMER and not warmup_given:  # the default warm-up, on the family's window
        window = {**H.FAMILIES[args.family][1], **args.family_override}["sliding_window"]
        args.warmup = window + 2 * args.prefill_step
    if not all(0 <= d < args.answer for d in args.divergences):
        p.error(f"every divergence must be in [0, --answer) = [0, {args.answer})")
    return args


class Server:
    """One system's server state for one path: its prompt cache (and, batched,
    its ``BatchGenerator``), served one request at a time as the server does."""

    def __init__(self, system: str, path: str, model, args, max_context: int):
        self.system, self.path, self.model, self.args = system, path, model, args
        self.key = (args.family, None, None)  # the server's model key: (model, adapter, draft)
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

    def request(self, prompt: List[int],
                max_tokens: Optional[int] = None) -> Tuple[float, int, List[int]]:
        """(time to first token, prompt tokens reused, the answer of ``max_tokens``
        tokens, default ``--answer``). ``self.fetch_s``: the prompt cache's part
        of the first token's time (its lookup, and what it evaluated)."""
        t0 = H.now()
        cache, rest = self.lru.fetch_nearest_cache(self.key, prompt)
        self.fetch_s = H.now() - t0
        reused = len(prompt) - len(rest)
        tokens = self.args.answer if max_tokens is None else max_tokens
        if self.batch is None:
            return self._single(t0, prompt, cache, rest, reused, tokens)
        return self._batched(t0, prompt, cache, reused, tokens)

    def _single(self, t0, prompt, cache, rest, reused, max_tokens):
        if cache is None:
            cache = make_prompt_cache(self.model)
        gen = generate_step(mx.array(rest), self.model, prompt_cache=cache,
                            max_tokens=max_tokens, prefill_step_size=self.args.prefill_step)
        answer = [int(next(gen)[0])]
        ttft = H.now() - t0
        answer += [int(t) for t, _ in gen]
        self.lru.insert_cache(self.key, prompt + answer, cache)
        return ttft, reused, answer

    def _batched(self, t0, prompt, cache, reused, max_tokens):
        bg = self.batch
        (uid,) = bg.insert_segments(segments=[[prompt[reused:]]], max_tokens=[max_tokens],
                                    caches=[cache], all_tokens=[prompt[:reused]])
        del cache
        segment_types = ["assistant"]  # a text request's one segment (server.py _tokenize)
        ttft, answer = None, []
        while True:
            prompt_responses, gen_responses = bg.next()
            ends = [r.uid for r in prompt_responses
                    if r.end_of_segment and not r.end_of_prompt and segment_types]
            for _, (c, key) in bg.extract_cache(ends).items():
                self.lru.insert_cache(self.key, key[:], c, cache_type=segment_types.pop())
            for r in gen_responses:
                if ttft is None:
                    ttft = H.now() - t0
                answer.append(int(r.token))
                if r.finish_reason is not None:
                    self.lru.insert_cache(self.key, r.all_tokens[:], r.prompt_cache,
                                          cache_type="assistant")
                    return ttft, reused, answer


def conversation(server: Server, history: List[int], users: List[List[int]],
                 d: int) -> List[Dict[str, Any]]:
    """Turn 0 (``history``), then ``len(users)`` returning turns, each sending
    back the last answer less its last ``d`` tokens (a client renders every
    turn the same way, so ``d`` is one per conversation)."""
    out, prompt, answer = [], list(history), []
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


def serve(system: str, path: str, model, args, max_context: int, history: List[int],
          users: List[List[int]], d: int) -> List[Dict[str, Any]]:
    """One conversation on a fresh server of ``system``; its turns."""
    server = Server(system, path, model, args, max_context)
    turns = [{"system": system, "path": path, **turn}
             for turn in conversation(server, history, users, d)]
    server.close()
    del server
    H.settle()
    return turns


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    length = args.history + args.repeats * (args.answer + args.user) + args.answer
    warm_length = args.warmup + args.answer + args.user + args.answer  # one returning turn
    max_context = args.max_context or -(-max(length, warm_length) // 256) * 256
    H.print_header(f"returning chat: time to first token on mlx-lm's server, {args.family}, "
                   "muser-kv vs mlx-lm", args,
                   extra=f"conversations up to {length:,} tokens; muser-kv max_context "
                         f"{max_context:,}")
    t = H.now()
    if args.family == GLIMMER:
        model = H.build_model(args)
    else:
        model = H.build_family(args.family, args.dtype, args.seed, args.family_override)
    vocab = model.args.vocab_size
    print(f"{H.describe(model)}; built in {H.now() - t:.1f} s")
    limit = (getattr(model.args, "max_position_embeddings", None)
             or H.FAMILY_CONTEXT.get(args.family))
    if max_context > limit:
        raise SystemExit(f"the conversation needs max_context {max_context:,}, past the model's "
                         f"context {limit:,}")
    rng = np.random.default_rng(args.seed)
    history = [int(x) for x in rng.integers(0, vocab, args.history)]
    users = [[int(x) for x in rng.integers(0, vocab, args.user)] for _ in range(args.repeats)]
    warm = [int(x) for x in rng.integers(0, vocab, args.warmup)]
    divergences = list(dict.fromkeys(args.divergences))
    results: List[Dict[str, Any]] = []
    for p, path in enumerate(args.paths):
        if args.warmup:  # both systems' prefill, reuse, trim and decode compiled before timing
            for system in H.SYSTEMS:
                serve(system, path, model, args, max_context, warm, users[:1],
                      min([d for d in divergences if d > 0] or [0]))
        for i, d in enumerate(divergences):  # one conversation per system, the order flipped
            for system in H.order(p * len(divergences) + i):
                t = H.now()
                results += serve(system, path, model, args, max_context, history, users, d)
                print(f"{path}, d = {d}, {system}: {args.repeats + 1} turns in {H.now() - t:.1f} s",
                      flush=True)
    rows, checks = [], []
    for path in args.paths:
        mine = [r for r in results if r["path"] == path]
        for d in ["cold (turn 0)"] + divergences:
            cell = {s: [r for r in mine if r["system"] == s and (
                r["turn"] == 0 if isinstance(d, str) else r["turn"] > 0 and r["d"] == d)]
                for s in H.SYSTEMS}
            theirs, ours = cell["mlx-lm"], cell["muser-kv"]
            t_mlx, t_ours = (H.median([r["ttft_s"] for r in x]) for x in (theirs, ours))
            rows.append([path, d, f"{theirs[0]['prompt']:,}-{theirs[-1]['prompt']:,}", t_mlx,
                         t_ours, H.ratio(t_mlx, t_ours), _reuse(theirs), _reuse(ours)])
        first = {s: next(r for r in mine if r["system"] == s) for s in H.SYSTEMS}
        checks.append([path, H.first_difference(first["mlx-lm"]["answer"],
                                                first["muser-kv"]["answer"])])
    print()
    H.table(["path", "d", "prompt tokens", "TTFT mlx-lm s", "TTFT muser-kv s", "mlx-lm / muser-kv",
             "reused / prompt, mlx-lm", "reused / prompt, muser-kv"], rows, digits=3,
            note="d: answer tokens at the end of the stored turn the client does not send back; "
                 "reused: prompt tokens the prompt cache supplied, per turn; TTFT: the median, "
                 "from the prompt-cache lookup to the first token (cold: one turn 0 per d)")
    H.table(["path", "turn 0 answers: first differing token"], checks,
            note="(greedy answers of a fresh prefill through both systems' caches; with random "
                 "weights near-ties make equality a weak signal, so it is reported, not asserted)")
    payload = {"benchmark": "returning_chat", "args": vars(args), "max_context": max_context,
               "results": results}
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
