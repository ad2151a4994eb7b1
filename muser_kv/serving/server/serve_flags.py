"""``muser-kv serve``'s own flags: added to mlx-lm's server parser (a group of
its own, after mlx-lm's flags), and the combinations it refuses."""

from __future__ import annotations

import argparse
import os
import types
from typing import Any, Iterable, Optional, Sequence

from muser_kv.caches.speculative import DEFAULT_RETAIN
from muser_kv.serving.arg_types import non_negative, positive
from muser_kv.serving.checkpoints import DEFAULT_CHECKPOINT, checkpoint_interval
from muser_kv.serving.server.body import DEFAULT_MAX_BODY_BYTES
from muser_kv.serving.server.http import (
    DEFAULT_BACKLOG,
    DEFAULT_CONNECTION_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_QUEUE_KEEPALIVE,
)
from muser_kv.serving.server.shutdown import DEFAULT_GRACE
from muser_kv.sessions.store.store import DEFAULT_MEMORY_BYTES

PROG = "muser-kv serve"
#: ``--prefill-budget``'s default (docs/serving.md says what it trades)
DEFAULT_PREFILL_BUDGET = 512

#: MLX CUDA's switch for cuDNN's attention, read once, at the process's first
#: attention call (``supports_sdpa_cudnn``): "0" keeps MLX's own kernels.
CUDNN_SWITCH = "MLX_CUDA_USE_CUDNN_SDPA"
#: what ``--cuda-attention``'s choices mean for a client (the start-up log says it)
ATTENTION = {"mlx": "decode muser-kv's, prefill chunks MLX's own kernels: a repeated request "
                    "gets identical tokens (--cuda-attention cudnn for cuDNN's prefill)",
             "cudnn": "decode muser-kv's, prefill chunks cuDNN's: a faster cold prefill, a "
                      "repeated request may get other tokens (--cuda-attention mlx for "
                      "identical ones)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """muser-kv's flags, as one group of the server's parser."""
    g = parser.add_argument_group("muser-kv caches")
    g.add_argument("--max-context", type=positive, default=None,
                   help="positions each sequence's caches hold (default: the model's "
                        "max_position_embeddings, else no preset bound); global planes grow "
                        "to it as a sequence does")
    g.add_argument("--retain", type=non_negative, default=DEFAULT_RETAIN,
                   help="overwritten rows each sliding ring keeps: how many tokens a cache "
                        "past the wrap can trim exactly, for prompt-cache reuse and "
                        f"speculative rollback (default {DEFAULT_RETAIN}; raised to "
                        "--num-draft-tokens when a draft model is loaded; 0: none)")
    g.add_argument("--sliding-layout", choices=("head_major", "token_major"), default="head_major",
                   help="the sliding rings' layout (default head_major: a batch's sliding "
                        "attention on CUDA reads head-major rings faster; docs/batching.md)")
    g.add_argument("--plane-dtype", choices=("float16", "bfloat16"), default=None,
                   help="the planes' dtype (default: the model's attention dtype, bf16 for a "
                        "bf16 model, else f16)")
    g.add_argument("--kv-store", default=None, metavar="DIR|redis://HOST:PORT",
                   help="a KV store tier behind the prompt cache: a directory (kept across "
                        "restarts) or a Redis server (shared between servers); the memory tier "
                        "is always there (docs/store.md)")
    g.add_argument("--kv-store-bytes", type=non_negative, default=None,
                   help="the --kv-store tier's bound in bytes, least recently used out "
                        "(default: unbounded)")
    g.add_argument("--kv-store-memory", type=non_negative, default=DEFAULT_MEMORY_BYTES,
                   help="the KV store's memory tier bound in bytes (default "
                        f"{DEFAULT_MEMORY_BYTES}; 0 with no --kv-store: no store)")
    g.add_argument("--kv-store-checkpoint", type=checkpoint_interval, default=DEFAULT_CHECKPOINT,
                   metavar="N",
                   help="put a prompt's state into the KV store at every multiple of N tokens "
                        "its prefill passes, so an edit inside a long prompt is rebuilt from "
                        "the checkpoint below it (a positive multiple of 256; default "
                        f"{DEFAULT_CHECKPOINT}; 0: off); batched requests only "
                        "(docs/store.md)")
    g.add_argument("--context-policy", choices=("shift", "error"), default="shift",
                   help="a request whose prompt and max_tokens do not fit --max-context: shift "
                        "(default) drops a chat's oldest whole turns (never its system messages "
                        "or newest turn) until it fits, and keeps a raw prompt that leaves no "
                        "room its --context-keep first tokens and newest suffix; error drops "
                        "nothing (a prompt that leaves no room is refused). The response's "
                        "X-Muser-Turns-Dropped / X-Muser-Tokens-Dropped headers say what went "
                        "(docs/serving.md)")
    g.add_argument("--context-keep", type=non_negative, default=0, metavar="N",
                   help="with --context-policy shift: the leading tokens a raw prompt "
                        "(/v1/completions) keeps when its middle is dropped (default 0)")
    g.add_argument("--kv-memory", type=positive, default=None, metavar="BYTES",
                   help="bytes of KV planes the server may hold: a request waits until the "
                        "planes of the sequences it joins and its own fit (every batch slot "
                        "at the longest sequence's planes), one whose planes alone do not "
                        "fit is refused, and prompt-cache entries are evicted to stay within "
                        "it (default: no bound)")
    g.add_argument("--prefill-budget", type=non_negative, default=DEFAULT_PREFILL_BUDGET,
                   metavar="TOKENS",
                   help="prompt tokens a decode step of the batch carries while sequences "
                        "decode: a prompt prefills in chunks of at most TOKENS (whether or "
                        "not others decode), and a running stream waits for at most one "
                        f"budget of prefill per token (default {DEFAULT_PREFILL_BUDGET}; 0: "
                        "mlx-lm's, a --prefill-step-size chunk per prompt in flight per "
                        "step; docs/serving.md)")
    g.add_argument("--cuda-attention", choices=("mlx", "cudnn"), default=None,
                   help="on MLX CUDA, the attention of prefill chunks (decode steps take "
                        "muser-kv's own kernels, whatever this says): mlx (the default, unless "
                        f"{CUDNN_SWITCH} is set) MLX's own, so a request served again (a "
                        "regenerate, after other traffic, after a restart over the same "
                        "--kv-store) gets identical tokens; cudnn: cuDNN's (MLX's default), "
                        "a faster cold prefill, but a repeated request may get other tokens "
                        "(docs/serving.md). No effect elsewhere")


def seconds(text: str) -> float:
    """An ``argparse`` type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text}")
    return value


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags bounding what the server takes from its clients (docs/serving.md)."""
    g = parser.add_argument_group("muser-kv server limits")
    g.add_argument("--listen-backlog", type=positive, default=DEFAULT_BACKLOG, metavar="N",
                   help="connections the listen queue holds while the server accepts "
                        f"(default {DEFAULT_BACKLOG}; the kernel may cap it: somaxconn)")
    g.add_argument("--max-connections", type=positive, default=DEFAULT_MAX_CONNECTIONS,
                   metavar="N",
                   help="connections open at once; one more is answered 503 at once "
                        f"(default {DEFAULT_MAX_CONNECTIONS})")
    g.add_argument("--connection-timeout", type=seconds, default=DEFAULT_CONNECTION_TIMEOUT,
                   metavar="SECONDS",
                   help="a connection that sends or takes no bytes for this long while its "
                        "request is read or its answer written is closed (an unfinished "
                        f"body gets 408; default {DEFAULT_CONNECTION_TIMEOUT:g})")
    g.add_argument("--max-body-bytes", type=positive, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="BYTES",
                   help=f"the largest request body read (default {DEFAULT_MAX_BODY_BYTES}); "
                        "a larger one gets 413")
    g.add_argument("--drain-grace", type=seconds, default=DEFAULT_GRACE, metavar="SECONDS",
                   help="on SIGTERM or SIGINT, how long running requests may take to finish "
                        "before they are ended with an error (default "
                        f"{DEFAULT_GRACE:g}); then the KV store's writes are flushed and the "
                        "server exits 0")
    g.add_argument("--queue-keepalive", type=seconds, default=DEFAULT_QUEUE_KEEPALIVE,
                   metavar="SECONDS",
                   help="a stream that waits in the queue gets its headers and an SSE comment "
                        "(': queued, N requests waiting') every this many seconds, so that "
                        f"its connection stays alive and its client knows (default "
                        f"{DEFAULT_QUEUE_KEEPALIVE:g})")
    g.add_argument("--allow-model-loading", action="store_true",
                   help="let a request's model, adapters or draft_model name another model "
                        "for the server to load (mlx-lm's behaviour); without it a request "
                        "may name only the served one (404 otherwise)")


def cuda_attention(choice: Optional[str], environ: Any = os.environ) -> str:
    """Set MLX CUDA's attention switch for ``choice`` and return what it is.

    Identical repeats need MLX's own kernels: cuDNN's decode attention gives
    other bits over the same rows from one run to the next
    (docs/serving.md), which no allocation of muser-kv's decides. Absent a
    choice an explicit ``MLX_CUDA_USE_CUDNN_SDPA`` stands. MLX reads the
    switch once, at its first attention call, so this runs as the flags are
    parsed, before any model loads."""
    if choice is None:
        given = environ.get(CUDNN_SWITCH)
        if given is not None and given.strip():
            try:
                return "cudnn" if int(given) else "mlx"
            except ValueError:
                raise ValueError(f"{CUDNN_SWITCH}={given!r}: MLX reads an integer "
                                 "(0: its own attention kernels, 1: cuDNN's)") from None
        choice = "mlx"
    environ[CUDNN_SWITCH] = "1" if choice == "cudnn" else "0"
    return choice


def check_arguments(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.draft_model is not None and ns.retain == 0:
        parser.error("--retain 0 keeps no overwritten rows, so no speculative rollback past the "
                     "wrap is exact; a --draft-model needs --retain >= --num-draft-tokens "
                     f"({ns.num_draft_tokens})")
    if ns.kv_bits is not None:
        parser.error("--kv-bits quantizes the KV cache through mlx-lm's to_quantized; "
                     "muser-kv's planes are exact f16/bf16 and are never quantized (mlx-lm's "
                     "own Muse Glimmer caches refuse it too: RotatingKVCache.to_quantized is "
                     "not implemented)")
    try:
        ns.cuda_attention = cuda_attention(ns.cuda_attention)
    except ValueError as e:
        parser.error(str(e))


def argparse_with(argv: Sequence[str]) -> types.ModuleType:
    """``argparse``, whose ``ArgumentParser`` is the server's parser with
    muser-kv's flags added, reading ``argv`` (not ``sys.argv``). The module's
    ``parsed`` is the namespace its last parse gave (``None`` before one), for
    what the server constructs without its arguments (``BatchGenerator``)."""

    class ArgumentParser(argparse.ArgumentParser):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs["prog"] = PROG
            kwargs["description"] = ("mlx-lm's HTTP server (mlx_lm.server: the same flags) with "
                                     "muser-kv's exact KV caches, whose global planes grow "
                                     "with each sequence (--kv-memory bounds them)")
            super().__init__(*args, **kwargs)
            self._muser_kv = False

        def parse_args(self, args: Optional[Iterable[str]] = None, namespace: Any = None) -> Any:
            if not self._muser_kv:  # after mlx-lm's own flags, so --help lists them last
                add_arguments(self)
                add_server_arguments(self)
                self._muser_kv = True
            ns = super().parse_args(list(argv) if args is None else args, namespace)
            check_arguments(self, ns)
            vars(module)["parsed"] = ns
            return ns

    module = types.ModuleType("argparse")
    module.__dict__.update(argparse.__dict__, ArgumentParser=ArgumentParser, parsed=None)
    return module
