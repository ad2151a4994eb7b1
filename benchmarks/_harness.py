"""The one harness of the benchmarks: flags, models, alternation, tables, JSON.

Every benchmark runs muser-kv and mlx-lm's own Muse Glimmer caches on the same
work in the same process, the systems alternating block by block (the order
flipped every block, so the machine's drift falls on both alike), and reports
ratios; absolute times are context, never a pass/fail criterion. Everything
runs on ``mx.default_device()`` (MLX's CPU here, CUDA or Metal elsewhere).

    p = parser(__doc__)                      # the docstring's first line, the question
    add_flags(p, MODEL, dtype="bfloat16", blocks=("repeats", 3, "..."))  # + add_*_flags
    args = parse(p, argv)                    # geometry left out: the real Muse Glimmer's
    model = build_model(args)                # random weights; describe(model)
    cache = prompt_cache(system, model)      # the K/V loop alone: make_caches, fill, attend_layers
    out = alternate(args.repeats, run)       # run(system, block) -> {system: [by block]}
    blocks = decode_blocks(steppers, state, args, pipelined)   # decode_steps, alternated
    print_header(title, args); table(columns, rows, title=..., note=...)
    write_json(args.json, payload)           # with the environment
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

import muser_kv
from muser_kv.caches import mlx_lm_attention

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
MB = MIB = 1 << 20
GIB = 1 << 30
GB = 1e9
SYSTEMS = ("muser-kv", "mlx-lm")
SETTLE_TOKENS = 4  # single-token updates that end a fill (mlx-lm's rings in their steady state)
PATTERNS = ("muse", "sliding", "global")

# -- flags -------------------------------------------------------------------------

#: geometry flag -> the ModelArgs field it sets (left out: the real Muse Glimmer's)
GEOMETRY = {"layers": "num_hidden_layers", "hidden": "hidden_size",
            "intermediate": "intermediate_size", "vocab": "vocab_size",
            "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "window": "sliding_window",
            "max_position": "max_position_embeddings"}
MODEL = tuple(GEOMETRY)  # a whole model
KV = ("layers", "window", "heads", "kv_heads", "head_dim")  # the K/V loop of _harness only


def int_list(text: str) -> List[int]:
    """``"2048,8192"`` -> ``[2048, 8192]`` (``k`` suffix allowed: ``128k``)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(part.rstrip("k")) * (1024 if part.endswith("k") else 1))
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}")
    return out


def one_int(text: str) -> int:
    """``"131072"`` or ``"128k"``."""
    values = int_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one int, got {text!r}")
    return values[0]


def str_list(text: str) -> List[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def choice_list(*allowed: str) -> Callable[[str], List[str]]:
    """An argparse type: a comma-separated list of some of ``allowed``."""
    def parse_list(text: str) -> List[str]:
        out = str_list(text)
        for x in out:
            if x not in allowed:
                raise argparse.ArgumentTypeError(f"unknown {x!r} (expected {','.join(allowed)})")
        return out
    return parse_list


def parser(doc: str) -> argparse.ArgumentParser:
    """The script's parser: its docstring's first line (the question) as the description."""
    return argparse.ArgumentParser(description=doc.split("\n")[0], epilog=doc.split("\n", 1)[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_flags(p: argparse.ArgumentParser, geometry: Sequence[str] = MODEL,
              defaults: Optional[Dict[str, int]] = None, dtype: Optional[str] = "float16",
              dtypes: Optional[str] = None, blocks: Optional[Tuple[str, int, str]] = None) -> None:
    """The shared group: the model's ``geometry`` flags (``defaults``, else the real
    Muse Glimmer's), ``--dtype`` (or ``--dtypes`` list), the alternating blocks
    flag ``blocks = (name, default, help)``, ``--seed``, ``--json``."""
    from mlx_lm.models import muse_glimmer

    real, defaults = muse_glimmer.ModelArgs(), defaults or {}
    g = p.add_argument_group("model geometry and run (geometry defaults: the real Muse Glimmer)")
    for name in geometry:
        value = defaults.get(name, getattr(real, GEOMETRY[name]))
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"{GEOMETRY[name]} (default {value})")
    if dtype:
        g.add_argument("--dtype", choices=sorted(DTYPES), default=dtype,
                       help=f"model / K-V dtype (default {dtype})")
    if dtypes:
        g.add_argument("--dtypes", type=choice_list(*DTYPES), default=str_list(dtypes),
                       help=f"model dtypes, one model each (default {dtypes})")
    if blocks:
        name, default, text = blocks
        g.add_argument(f"--{name}", type=int, default=default, help=f"{text} (default {default})")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", metavar="FILE", help="also write all measurements as JSON")
    g.add_argument("--buffer-cache", choices=("on", "off"), default="on",
                   help="MLX's buffer cache: on (MLX's default) or off for the whole run "
                        "(mx.set_cache_limit(0) and one mx.clear_cache(): every buffer "
                        "allocated at its own size)")
    p.set_defaults(_geometry_defaults=defaults)


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    """muser-kv's knobs for the K/V loop (``make_caches``)."""
    g = p.add_argument_group("caches")
    g.add_argument("--pattern", choices=PATTERNS, default="muse",
                   help="layer kinds: muse (layer i global iff i %% 4 == 3; default), or every "
                        "layer sliding / global (to attribute a difference to one kind)")
    g.add_argument("--retain", type=int, default=muser_kv.DEFAULT_RETAIN,
                   help=f"rows each sliding ring retains for exact trim (default "
                        f"{muser_kv.DEFAULT_RETAIN}; 0 = off)")
    g.add_argument("--sliding-layout", choices=["token_major", "head_major"], default="token_major",
                   help="muser-kv's sliding-ring layout (default token_major)")
    g.add_argument("--plane-dtype", choices=["follow", "float16", "bfloat16"], default="follow",
                   help="muser-kv's plane type (default follow: bf16 for --dtype bfloat16, else "
                        "f16, as make_prompt_cache picks for a model of that dtype)")


def add_decode_flags(p: argparse.ArgumentParser, depths: str) -> None:
    """The decode loop's flags (``decode_steps``)."""
    g = p.add_argument_group("decode")
    g.add_argument("--depths", type=int_list, default=int_list(depths),
                   help=f"context depths to decode at (default {depths})")
    g.add_argument("--steps", type=int, default=None,
                   help="timed decode steps per block (default 64 on GPU, 16 on CPU)")
    g.add_argument("--warmup", type=int, default=4, help="untimed steps per mode (default 4)")
    g.add_argument("--modes", type=choice_list("sync", "pipelined"), default=["sync", "pipelined"],
                   help="sync,pipelined (default both)")
    g.add_argument("--fill-chunk", type=int, default=4096,
                   help="chunk size the caches are filled with (default 4096)")


def add_prefill_flags(p: argparse.ArgumentParser) -> None:
    """generate_step's prefill chunk, and the untimed warm-up run every timed path needs."""
    g = p.add_argument_group("prefill")
    g.add_argument("--prefill-step", type=int, default=2048,
                   help="generate_step's prefill_step_size (default 2048, mlx-lm's)")
    g.add_argument("--warmup", type=int, default=None,
                   help="prompt tokens of an untimed run per system first (default: window + 2 "
                        "prefill steps, so that every prefill path -- in place and across the "
                        "wrap -- and decode are compiled before timing; 0: none)")


def parse(p: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parsed flags, those left out resolved: geometry (the script's default, else the
    real Muse Glimmer's), ``--steps`` (64 on GPU, 16 on CPU), ``--warmup`` (of a prefill)."""
    from mlx_lm.models import muse_glimmer

    args = p.parse_args(argv)
    real, defaults = muse_glimmer.ModelArgs(), vars(args).pop("_geometry_defaults", {})
    for name, field in GEOMETRY.items():
        if getattr(args, name, 0) is None:
            setattr(args, name, defaults.get(name, getattr(real, field)))
    if getattr(args, "steps", 0) is None:
        args.steps = 64 if on_gpu() else 16
    if getattr(args, "prefill_step", None) and args.warmup is None:
        args.warmup = args.window + 2 * args.prefill_step
    if getattr(args, "buffer_cache", "on") == "off":
        mx.set_cache_limit(0)
        mx.clear_cache()  # a limit keeps what is cached: nothing may be handed out again
    return args


# -- models and caches -------------------------------------------------------------------


def model_args(args: argparse.Namespace, **overrides: Any):
    from mlx_lm.models import muse_glimmer

    fields = {f: getattr(args, n) for n, f in GEOMETRY.items() if getattr(args, n, None) is not None}
    return muse_glimmer.ModelArgs(**{**fields, **overrides})


def build_model(args: argparse.Namespace, dtype: Optional[str] = None, **overrides: Any):
    """mlx-lm's Muse Glimmer with random weights (seeded) at the flags' geometry
    (``overrides``: ModelArgs fields), cast to ``dtype`` (default ``--dtype``), evaluated."""
    from mlx_lm.models import muse_glimmer

    mx.random.seed(args.seed)
    model = muse_glimmer.Model(model_args(args, **overrides))
    model.set_dtype(DTYPES[dtype or args.dtype])
    mx.eval(model.parameters())
    return model


#: The shapes of real checkpoints' configs (random weights): the families the
#: end-to-end benchmark runs beside Muse Glimmer.
FAMILIES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "gemma3-27b": ("gemma3_text", dict(
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
        num_key_value_heads=16, head_dim=128, sliding_window=1024, sliding_window_pattern=6,
        vocab_size=262208, max_position_embeddings=131072, query_pre_attn_scalar=168,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rms_norm_eps=1e-6,
        rope_scaling={"factor": 8.0, "rope_type": "linear"})),
    "gpt-oss-20b": ("gpt_oss", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_local_experts=32,
        num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        sliding_window=128, vocab_size=201088, rope_theta=150000,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False},
        layer_types=["sliding_attention", "full_attention"] * 12)),
}
#: what a family's checkpoint says its context is, where mlx-lm's args drop it
FAMILY_CONTEXT = {"gemma3-27b": 131072, "gpt-oss-20b": 131072}


def overrides(text: str) -> Dict[str, Any]:
    """An argparse type: ``key=value,...`` -> ``{key: value}``, each value read as
    JSON where it parses (``64``, ``1e-6``, ``null``, ``["a","b"]``), else as a
    string; commas inside brackets or braces belong to the value."""
    out: Dict[str, Any] = {}
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    for part in filter(None, parts):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value, got {part!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def build_family(name: str, dtype: str, seed: int = 0,
                 override: Optional[Dict[str, Any]] = None):
    """A ``FAMILIES`` model with random weights (seeded), cast to ``dtype``, evaluated.
    ``override``: ModelArgs fields in place of the family's (a smaller model of the
    same code, for a CPU check); a ``num_hidden_layers`` that leaves the family's
    ``layer_types`` alone keeps its first entries, the family's pattern."""
    import importlib

    module, fields = FAMILIES[name]
    fields = {**fields, **(override or {})}
    if "layer_types" in fields and "layer_types" not in (override or {}):
        fields["layer_types"] = fields["layer_types"][:fields["num_hidden_layers"]]
    lib = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(seed)
    model = lib.Model(lib.ModelArgs(model_type=module, **fields))
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    return model


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def describe(model) -> str:
    from mlx.utils import tree_flatten

    a = model.args
    dtype = tree_flatten(model.parameters())[0][1].dtype
    return (f"model: {a.model_type}, {a.num_hidden_layers} layers, hidden {a.hidden_size}, vocab "
            f"{a.vocab_size}, window {a.sliding_window}, {a.num_attention_heads} heads / "
            f"{a.num_key_value_heads} KV x {a.head_dim}, {dtype_name(dtype)}: "
            f"{weight_bytes(model) / GIB:.2f} GiB of weights; "
            f"muser-kv planes {dtype_name(muser_kv.plane_dtype_for(model))}")


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def prompt_cache(system: str, model, max_context: Optional[int] = None) -> List[Any]:
    """A model's cache: muser-kv's ``make_prompt_cache``, or its own ``make_cache()``."""
    if system == "muser-kv":
        return muser_kv.make_prompt_cache(model, max_context=max_context)
    return model.make_cache()


def is_global(i: int, pattern: str = "muse") -> bool:
    if pattern == "muse":
        return i % 4 == 3  # Muse Glimmer's partition
    return pattern == "global"


def plane_dtype(args: argparse.Namespace) -> mx.Dtype:
    """The planes make_prompt_cache gives a model whose K/V arrive in ``--dtype``."""
    if getattr(args, "plane_dtype", "follow") != "follow":
        return DTYPES[args.plane_dtype]
    return mx.bfloat16 if args.dtype == "bfloat16" else mx.float16


def geometry(args: argparse.Namespace, max_context: Optional[int] = None) -> "muser_kv.MuseGeometry":
    """muser-kv's geometry for the flags, sized for ``max_context`` (default ``args.max_context``)."""
    kind, pattern = muser_kv.LayerKind, getattr(args, "pattern", "muse")
    return muser_kv.MuseGeometry(
        num_layers=args.layers, window=args.window, max_context=max_context or args.max_context,
        num_heads=getattr(args, "heads", args.kv_heads), kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        layer_kinds=tuple(kind.GLOBAL if is_global(i, pattern) else kind.SLIDING
                          for i in range(args.layers)))


def make_caches(system: str, args: argparse.Namespace) -> List[Any]:
    """One cache per layer for the K/V loop: muser-kv's (planes allocated and
    zero-filled here), or what Muse Glimmer's ``make_cache()`` returns."""
    if system == "muser-kv":
        return muser_kv.make_cache_for(geometry(args), args.retain, args.sliding_layout,
                                       plane_dtype(args))
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    return [KVCache() if is_global(i, args.pattern) else RotatingKVCache(max_size=args.window, keep=0)
            for i in range(args.layers)]


def fill(caches: Sequence[Any], depth: int, kv_heads: int, head_dim: int, dtype, chunk: int,
         key: mx.array, singles: int = 0) -> Sequence[Any]:
    """Every cache to ``depth`` tokens of the same random K/V (drawn from ``key``),
    through its own ``update_and_fetch``: ``chunk``-row updates, then ``singles``
    one-token ones (mlx-lm's RotatingKVCache then in its steady ring state)."""
    block = mx.random.normal((1, kv_heads, min(chunk, depth), head_dim), key=key).astype(dtype)
    mx.eval(block)
    done = 0
    while done < depth:
        n = 1 if done >= depth - singles else min(block.shape[2], depth - singles - done)
        for c in caches:
            c.update_and_fetch(block[:, :, :n], block[:, :, :n])
        mx.eval([c.state for c in caches])
        done += n
    assert all(c.offset == depth for c in caches), [c.offset for c in caches]
    return caches


def attend_layers(caches: List[Any], x: mx.array, args: argparse.Namespace) -> mx.array:
    """One chunk of ``x.shape[2]`` tokens (1 = a decode step) through every
    layer: store K/V (drawn from the hidden state), attend with SDPA; returns
    the last layer's output (lazy). Masks are made once per layer kind from
    its first cache, called exactly as ``create_attention_mask`` calls them."""
    n, kvh, scale = x.shape[2], args.kv_heads, args.head_dim ** -0.5
    masks: Dict[bool, Any] = {}
    for i, c in enumerate(caches):
        g = is_global(i, args.pattern)
        if g not in masks:
            masks[g] = c.make_mask(n, return_array=False, window_size=None if g else args.window)
    h = x
    for i, c in enumerate(caches):
        k, v = c.update_and_fetch(mx.tanh(h[:, :kvh]), mx.tanh(h[:, kvh:2 * kvh]))
        # as mlx-lm's models call it once muser-kv routed them: a muser-kv cache's
        # decode step takes muser-kv's decode attention (set_decode_attention)
        out = mlx_lm_attention.scaled_dot_product_attention(
            h, k, v, cache=c, scale=scale, mask=masks[is_global(i, args.pattern)])
        h = (h + out.astype(h.dtype)) * 0.5
    return h


# -- running: alternation, decode loops, memory ----------------------------------------


def order(block: int, systems: Sequence[str] = SYSTEMS) -> Sequence[str]:
    """The systems in ``block``'s order: as given on even blocks, reversed on odd ones."""
    return tuple(systems) if block % 2 == 0 else tuple(systems)[::-1]


def alternate(blocks: int, run: Callable[[str, int], Any], systems: Sequence[str] = SYSTEMS,
              first: int = 0) -> Dict[str, List[Any]]:
    """``run(system, block)`` for every block and system, the order flipped every
    block (``first``: the parity of block 0); ``{system: [its results, by block]}``."""
    out: Dict[str, List[Any]] = {s: [] for s in systems}
    for b in range(blocks):
        for s in order(b + first, systems):
            out[s].append(run(s, b))
    return out


def decode_steps(step: Callable[[Any], Any], h: Any, n: int,
                 pipelined: bool) -> Tuple[Any, float, float]:
    """``n`` steps of ``h = step(h)``: ``mx.eval`` after each (sync), or mlx-lm's
    ``generate_step`` pattern (build and ``async_eval`` step t+1, then wait on
    step t). Returns (h, seconds, of which building the graphs)."""
    build, t0 = 0.0, now()
    for i in range(n):
        b = now()
        nh = step(h)
        build += now() - b
        if not pipelined:
            mx.eval(nh)
        else:
            mx.async_eval(nh)
            if i:
                mx.eval(h)
        h = nh
    mx.eval(h)
    return h, now() - t0, build


def decode_blocks(steppers: Dict[str, Callable[[Any], Any]], state: Dict[str, Any], args,
                  pipelined: bool) -> Dict[str, List[Dict[str, float]]]:
    """``--warmup`` untimed steps per system, then ``--repeats`` alternating blocks
    of ``--steps`` (``steppers[s]``: system ``s``'s step; ``state[s]``: its running
    hidden state, updated): per system and block, ms/token, build ms/token and the
    peak above what was active before (``PeakProbe``)."""
    def block(s: str, n: int) -> Dict[str, float]:
        with PeakProbe() as probe:
            state[s], dt, build = decode_steps(steppers[s], state[s], n, pipelined)
        return {"ms_per_token": dt / n * 1e3, "build_ms_per_token": build / n * 1e3,
                "peak_extra_bytes": probe.extra}

    for s in steppers:
        block(s, args.warmup)
    return alternate(args.repeats, lambda s, _: block(s, args.steps), tuple(steppers))


@contextmanager
def clock(into: Dict[str, Any], key: str) -> Iterator[None]:
    """Times its block (seconds) into ``into[key]``."""
    t0 = now()
    yield
    into[key] = now() - t0


def settle() -> None:
    """Finish outstanding work and drop cached buffers before a measurement."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


class PeakProbe:
    """Peak memory during a block, minus what was active when it started.

    A transient copy of a plane (a slice update that could not reuse its buffer)
    shows up here as extra bytes of about the plane's size."""

    def __enter__(self) -> "PeakProbe":
        settle()
        self.before = mx.get_active_memory()
        mx.reset_peak_memory()
        return self

    def __exit__(self, *exc: Any) -> None:
        mx.synchronize()
        self.peak = mx.get_peak_memory()
        self.after = mx.get_active_memory()
        self.extra = max(0, self.peak - self.before)


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def now() -> float:
    return time.perf_counter()


def ratio(theirs: float, ours: float) -> float:
    return theirs / ours if ours > 0 else float("nan")


def bits(x: mx.array) -> np.ndarray:
    """An array's bit patterns (uint16 / uint32), for bitwise comparisons."""
    return np.array(x.view(mx.uint16) if x.dtype.size == 2 else x.view(mx.uint32))


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def can_evict() -> bool:
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def evict(path: str) -> None:
    """Drop this (fsync'd, so clean) file's pages from the page cache; nothing else."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def launch_port() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free (mlx.launch takes consecutive ports)."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free loopback ports")


# -- output: header, tables, JSON --------------------------------------------------------


def huge_pages() -> str:
    """Whether fresh MLX memory on the CPU gets transparent huge pages: the
    kernel's THP mode, and glibc's ``hugetlb`` tunable (MLX's CPU allocator is
    ``malloc``; with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` glibc asks for
    THP on its large chunks, as numpy does for its arrays)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = next((w.strip("[]") for w in f.read().split() if w.startswith("[")), "?")
    except OSError:
        mode = "n/a"
    return f"THP {mode}, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', 'unset')}"


def environment() -> Dict[str, Any]:
    import mlx_lm

    try:
        info = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                for k, v in mx.device_info().items()}
    except Exception:  # pragma: no cover
        info = {}
    return {"device": str(mx.default_device()), "device_info": info, "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "huge_pages": huge_pages(),
            "argv": sys.argv}


def _flag(name: str, value: Any) -> str:
    """``--name value`` as a shell reads it back (``--name=value`` where the
    value itself starts with a dash, as argparse would take it for a flag)."""
    flag = f"--{name.replace('_', '-')}"
    text = str(value)
    return f"{flag}={shlex.quote(text)}" if text.startswith("-") else f"{flag} {shlex.quote(text)}"


def print_header(title: str, args: argparse.Namespace, extra: Optional[str] = None) -> None:
    """The title, the environment (device, MLX, mlx-lm, CPUs, huge pages), every flag."""
    env = environment()
    print(f"# {title}")
    print(f"device {env['device']} {env['device_info'].get('device_name', '')} | "
          f"mlx {env['mlx']} | mlx-lm {env['mlx_lm']} | {env['cpus']} CPUs | {env['huge_pages']}")
    flags = [(k, ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
             for k, v in vars(args).items() if v not in (None, []) and k != "json"]
    print("flags: " + " ".join(_flag(k, v) for k, v in flags))
    if extra:
        print(extra)
    print()


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2,
          title: Optional[str] = None, note: Optional[str] = None) -> None:
    """``title``, a GitHub-flavoured Markdown table (readable in a terminal, pasteable
    in docs; floats to ``digits``, NaN as "-"), then ``note`` (what its columns mean)."""
    cells = [[("-" if c != c else f"{c:,.{digits}f}") if isinstance(c, float) else str(c)
              for c in row] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]

    def line(items: Sequence[str]) -> str:
        return "| " + " | ".join(x.rjust(w) for x, w in zip(items, widths)) + " |"

    out = ([title, ""] if title else []) + [line(columns)]
    out += ["|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"] + [line(r) for r in cells]
    print("\n".join(out + [""] + ([note, ""] if note else [])))


def write_json(path: Optional[str], payload: Dict[str, Any]) -> None:
    """``payload`` with the environment, as JSON, to ``path`` (None: nowhere)."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"environment": environment(), **payload}, f, indent=2, default=str)
    print(f"wrote {path}")
