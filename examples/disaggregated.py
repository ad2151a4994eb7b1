"""Prefill here, decode there: one process prefills each conversation, another decodes it.

    mlx.launch -n 2 --backend ring --python .venv/bin/python examples/disaggregated.py

Rank 0 is the prefill worker. For each conversation it tokenizes the prompt,
runs all of it but the last token through the model into a muser-kv cache (in
``--chunk``-token steps, as mlx-lm's ``generate_step`` prefills) and hands the
session to rank 1 with ``muser_kv.handoff.send_session``: the rows, the ring
origins, the model's fingerprint and, as metadata, the prompt's last token.
Rank 1 is the decode worker: ``recv_session`` verifies the session and installs
it, bit for bit, in a new cache, and mlx-lm's ``generate_step`` decodes from
the last prompt token. While rank 1 decodes conversation ``i``, rank 0 is
already prefilling conversation ``i + 1``.

The model is mlx-lm's Muse Glimmer with random weights (a small hidden size,
the real KV geometry of 2 KV heads x 128, a 32-token window so every prompt
wraps the rings) and the tokenizer a word-level one built here: no downloads.
The words that come out are random; what matters is that they are the ones a
single process would produce. ``--check`` makes rank 1 also run mlx-lm's
``generate_step`` on the whole prompt itself and compare every token and every
logprob bit: exit status 1 on any difference.

Should a handoff fail -- the other rank gone, a session refused -- the rank
that saw it prints the error and exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.muse_glimmer import Model, ModelArgs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import muser_kv
from muser_kv.sessions import handoff

WORDS = """
the a an and or but of to in on at for with from by about as into over under after
before while when where why how what who which that this these those it its they them
their we us our you your he she his her i me my is are was were be been being have has
had do does did can could will would should may might must shall not no yes very more
most less some any all each every many much few other another same new old good great
small large long short early late first last next ship sea storm harbour captain crew
sail wind wave waves island lighthouse night morning map star compass rope anchor deck
question answer answers story tell explain help helps find came gone assistant user
system kind sentences know say : . ,
""".split()
EOS = "</s>"
SYSTEM = ("system : you are a kind assistant who answers in short sentences . you tell the "
          "user what you know and you say no when you do not know . user : ")
CONVERSATIONS = [
    SYSTEM + "tell me a story about the old captain and the storm that came before the morning",
    SYSTEM + "explain how a compass helps a crew find the harbour at night when every star is "
             "gone",
    SYSTEM + "what should a new crew do first when the wind is great , the waves are long and "
             "the ship is small",
]
KV_HEADS, HEAD_DIM = 2, 128


def build_tokenizer() -> Tokenizer:
    """A word-level tokenizer over ``WORDS`` (ids in order, ``</s>`` last)."""
    vocab = {w: i for i, w in enumerate(dict.fromkeys(WORDS))}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    return tok


def build_model(ns: argparse.Namespace, vocab: int) -> Model:
    """mlx-lm's Muse Glimmer, random weights from ``--seed`` (the same on both ranks)."""
    args = ModelArgs(hidden_size=ns.hidden, num_hidden_layers=ns.layers,
                     intermediate_size=3 * ns.hidden, num_attention_heads=4,
                     num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=vocab,
                     sliding_window=ns.window, max_position_embeddings=ns.max_context)
    mx.random.seed(ns.seed)
    model = Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def prefill(model: Model, ids: Sequence[int], chunk: int) -> list:
    """All of ``ids`` through the model into a new muser-kv cache, ``chunk`` at a time."""
    cache = muser_kv.make_prompt_cache(model)
    for s in range(0, len(ids), chunk):
        model(mx.array([list(ids[s:s + chunk])]), cache=cache)
        mx.eval([c.kv_state for c in cache])
    return cache


def decode(model: Model, cache: list, prompt: Sequence[int], tokens: int,
           chunk: int) -> Tuple[List[int], List[np.ndarray], float]:
    """mlx-lm's ``generate_step`` on ``prompt`` over ``cache``: greedy tokens, their
    logprobs, and the seconds to the first token."""
    out, logprobs, first = [], [], 0.0
    start = time.perf_counter()
    for token, lp in generate_step(mx.array(list(prompt)), model, prompt_cache=cache,
                                   max_tokens=tokens, prefill_step_size=chunk):
        if not out:
            first = time.perf_counter() - start
        out.append(int(token))
        logprobs.append(np.array(lp.astype(mx.float32)))
    return out, logprobs, first


def prefill_worker(group, model: Model, conversations: List[List[int]],
                   ns: argparse.Namespace) -> int:
    for n, ids in enumerate(conversations, 1):
        t = time.perf_counter()
        cache = prefill(model, ids[:-1], ns.chunk)
        prefilled = time.perf_counter() - t
        t = time.perf_counter()
        sent = handoff.send_session(cache, 1, group, metadata={"conversation": n,
                                                               "last": ids[-1]})
        print(f"[prefill] conversation {n}: {len(ids) - 1} tokens in {prefilled * 1e3:.0f} ms; "
              f"installed on rank 1 {(time.perf_counter() - t) * 1e3:.0f} ms later "
              f"({sent.nbytes / 1024:.0f} KiB at position {sent.position}; rank 1 takes it "
              "once it is done with the one before)", flush=True)
    return 0


def decode_worker(group, model: Model, tokenizer: Tokenizer, conversations: List[List[int]],
                  ns: argparse.Namespace) -> int:
    status = 0
    for ids in conversations:
        got = handoff.recv_session(model, 0, group, wait=ns.wait)
        n, last = got.metadata["conversation"], got.metadata["last"]
        tokens, logprobs, first = decode(model, got.cache, [last], ns.tokens, ns.chunk)
        line = (f"[decode]  conversation {n}: from position {got.position}, first token "
                f"after {first * 1e3:.0f} ms: {tokenizer.decode(tokens)!r}")
        if ns.check:
            alone, alone_lp, _ = decode(model, muser_kv.make_prompt_cache(model), ids,
                                        ns.tokens, ns.chunk)
            same = alone == tokens and all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
                                           for a, b in zip(alone_lp, logprobs))
            line += f"; one process alone: {'the same tokens and logprob bits' if same else 'DIFFERENT'}"
            status |= 0 if same else 1
        print(line, flush=True)
    return status


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="decoder layers (i % 4 == 3 global)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--window", type=int, default=32, help="sliding window (ring capacity)")
    p.add_argument("--max-context", type=int, default=256, help="positions a cache holds")
    p.add_argument("--chunk", type=int, default=16, help="prefill chunk (prefill_step_size)")
    p.add_argument("--tokens", type=int, default=12, help="tokens to decode per conversation")
    p.add_argument("--conversations", type=int, default=len(CONVERSATIONS),
                   help=f"how many of the {len(CONVERSATIONS)} conversations to run")
    p.add_argument("--wait", type=float, default=120.0,
                   help="seconds the decode worker waits for a session to start arriving")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--check", action="store_true",
                   help="rank 1 also decodes each whole prompt alone and compares bit for bit")
    ns = p.parse_args(argv)
    if not 1 <= ns.conversations <= len(CONVERSATIONS):
        p.error(f"--conversations must be in 1..{len(CONVERSATIONS)}")
    return ns


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)
    group = mx.distributed.init(backend="ring", strict=True)
    if group.size() != 2:
        print(f"needs exactly 2 ranks, got {group.size()}: run it with "
              "mlx.launch -n 2 --backend ring", file=sys.stderr)
        return 2
    tokenizer = build_tokenizer()
    model = build_model(ns, tokenizer.get_vocab_size())
    conversations = [tokenizer.encode(c).ids for c in CONVERSATIONS[:ns.conversations]]
    unknown = [w for c in CONVERSATIONS for w in c.split() if w not in tokenizer.get_vocab()]
    if unknown:
        raise SystemExit(f"words missing from the example's vocabulary: {unknown}")
    try:
        if group.rank() == 0:
            return prefill_worker(group, model, conversations, ns)
        return decode_worker(group, model, tokenizer, conversations, ns)
    except (handoff.HandoffError, muser_kv.SnapshotError) as e:
        print(f"rank {group.rank()}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # a link that failed may leave a transfer blocked: leave without the
        # interpreter's shutdown, which that transfer could interrupt
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
