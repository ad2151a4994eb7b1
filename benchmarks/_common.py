"""Helpers shared by the benchmarks: flags, memory probes, tables, JSON.

Every benchmark compares muser-kv against mlx-lm's own caches on the same work
in the same process and reports ratios; absolute times are printed for context
only and are never a pass/fail criterion. Everything runs on
``mx.default_device()`` (the CPU backend here, CUDA or Metal elsewhere).

Only the public muser-kv API is used (``MuseGeometry``, ``make_cache_for``,
``update_and_fetch``, ``make_mask``, ``offset``, ``nbytes``, ``footprint``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

import muser_kv

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
MB = 1 << 20


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def int_list(text: str) -> List[int]:
    """``"2048,8192"`` -> ``[2048, 8192]`` (``k`` suffix allowed: ``128k``)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * scale)
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}")
    return out


def str_list(text: str) -> List[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


SYSTEMS = ("muser-kv", "mlx-lm")
PATTERNS = ("muse", "sliding", "global")


def is_global(i: int, pattern: str = "muse") -> bool:
    if pattern == "muse":
        return i % 4 == 3  # Muse Glimmer's partition
    return pattern == "global"


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The Muse-shaped geometry both systems are built for, and muser-kv's knobs."""
    p.add_argument("--layers", type=int, default=52, help="layers (default 52, Muse Glimmer)")
    p.add_argument("--window", type=int, default=2048, help="sliding window (default 2048)")
    p.add_argument("--pattern", choices=PATTERNS, default="muse",
                   help="layer kinds: muse (layer i global iff i %% 4 == 3; default), or every "
                        "layer sliding / global (to attribute a difference to one kind)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--retain", type=int, default=muser_kv.DEFAULT_RETAIN,
                   help="rows each sliding ring retains for exact trim (default 16; 0 = off)")
    p.add_argument("--sliding-layout", choices=["token_major", "head_major"], default="token_major",
                   help="muser-kv's sliding-ring layout (default token_major, the seeds')")
    p.add_argument("--plane-dtype", choices=["follow", "float16", "bfloat16"], default="follow",
                   help="muser-kv's plane type (default follow: bf16 for --dtype bfloat16, else "
                        "f16, as make_prompt_cache picks for a model of that dtype)")


def plane_dtype(args: argparse.Namespace) -> mx.Dtype:
    """The planes make_prompt_cache gives a model whose K/V arrive in ``--dtype``."""
    if args.plane_dtype != "follow":
        return DTYPES[args.plane_dtype]
    return mx.bfloat16 if args.dtype == "bfloat16" else mx.float16


def geometry(args: argparse.Namespace) -> "muser_kv.MuseGeometry":
    """muser-kv's geometry for the model flags, sized for ``args.max_context``."""
    kind = muser_kv.LayerKind
    return muser_kv.MuseGeometry(
        num_layers=args.layers, window=args.window, max_context=args.max_context,
        num_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        layer_kinds=tuple(kind.GLOBAL if is_global(i, args.pattern) else kind.SLIDING
                          for i in range(args.layers)),
    )


def make_caches(system: str, args: argparse.Namespace) -> List[Any]:
    """One cache per layer: muser-kv's (planes allocated and zero-filled here), or
    what Muse Glimmer's ``make_cache()`` returns."""
    if system == "muser-kv":
        return muser_kv.make_cache_for(geometry(args), args.retain, args.sliding_layout,
                                       plane_dtype(args))
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    return [KVCache() if is_global(i, args.pattern)
            else RotatingKVCache(max_size=args.window, keep=0)
            for i in range(args.layers)]


def attend_layers(caches: List[Any], x: mx.array, args: argparse.Namespace) -> mx.array:
    """One chunk of ``x.shape[2]`` tokens (1 = a decode step) through every
    layer: store K/V (drawn from the hidden state), attend with SDPA; returns
    the last layer's output (lazy). Masks are made once per layer kind from
    its first cache, called exactly as ``create_attention_mask`` calls them
    (as ``MuseGlimmerModel._masks`` does)."""
    n = x.shape[2]
    kvh, scale = args.kv_heads, args.head_dim ** -0.5
    masks: Dict[bool, Any] = {}
    for i, c in enumerate(caches):
        g = is_global(i, args.pattern)
        if g not in masks:
            masks[g] = c.make_mask(n, return_array=False, window_size=None if g else args.window)
    h = x
    for i, c in enumerate(caches):
        k, v = c.update_and_fetch(mx.tanh(h[:, :kvh]), mx.tanh(h[:, kvh:2 * kvh]))
        out = mx.fast.scaled_dot_product_attention(h, k, v, scale=scale,
                                                   mask=masks[is_global(i, args.pattern)])
        h = (h + out.astype(h.dtype)) * 0.5
    return h


def add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                   help="dtype of the K/V (and queries) handed to the caches (default float16)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats per cell; the table shows the median (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write all measurements as JSON")


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


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def now() -> float:
    return time.perf_counter()


def environment() -> Dict[str, Any]:
    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover
        mlx_lm_version = None
    try:
        info = mx.device_info()
        info = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                for k, v in info.items()}
    except Exception:  # pragma: no cover
        info = {}
    return {
        "device": str(mx.default_device()),
        "device_info": info,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "huge_pages": huge_pages(),
        "argv": sys.argv,
    }


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


def print_header(title: str, args: argparse.Namespace, extra: Optional[str] = None) -> None:
    env = environment()
    print(f"# {title}")
    print(f"device {env['device']} {env['device_info'].get('device_name', '')} | "
          f"mlx {env['mlx']} | mlx-lm {env['mlx_lm']} | {env['cpus']} CPUs | {env['huge_pages']}")
    flags = " ".join(f"--{k.replace('_', '-')} {_flag_value(v)}" for k, v in vars(args).items()
                     if v is not None and k != "json")
    print(f"flags: {flags}")
    if extra:
        print(extra)
    print()


def _flag_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def fmt(v: Any, digits: int = 2) -> str:
    if isinstance(v, float):
        if v != v:  # nan
            return "-"
        return f"{v:,.{digits}f}"
    return str(v)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> None:
    """A GitHub-flavoured Markdown table (readable in a terminal, pasteable in docs)."""
    cells = [[fmt(c, digits) for c in row] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) if cells else len(col)
              for i, col in enumerate(columns)]
    def line(items):
        return "| " + " | ".join(s.rjust(w) for s, w in zip(items, widths)) + " |"
    print(line(columns))
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for r in cells:
        print(line(r))
    print()


def write_json(path: Optional[str], payload: Dict[str, Any]) -> None:
    if not path:
        return
    payload = {"environment": environment(), **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {path}")


def ratio(theirs: float, ours: float) -> float:
    return theirs / ours if ours > 0 else float("nan")
