"""Decode attention on NVIDIA tensor cores (``mma.sync`` m16n8k16), in one launch.

``attend_mma`` runs ``kernels/attend_mma.cu`` (body) with
``kernels/attend_mma.h`` (device helpers) through ``mx.fast.cuda_kernel``: one
threadblock of ``THREADS`` threads per (sequence, K/V head, chunk, M tile of 16
query rows). Each block writes its chunk's partial:

``partials[b, h, c, r, :]`` (float32, ``D + 2`` wide) for query row
``r = i * G + g`` (token ``i``, head ``g`` of K/V head ``h``'s group) and chunk
``c`` (positions ``(first + c) * CHUNK ..``): ``0..D-1`` the sum of
``exp(s_j - m) * v_j``, ``D`` the max score ``m``, ``D + 1`` the sum ``l`` of
``exp(s_j - m)``; a row that sees no key of the chunk (or ``c >= count``) gets
``m = -inf``, ``l = 0``, ``o = 0``.

Then, in the same launch, each group of ``FOLD`` chunks is folded
(``merged``) once all its partials are written, and each sequence's (head's,
tile's) last group combines the folds into the output once every group is
folded, with ``kernels/attend_merge.inc`` and ``attend_combine.inc``'s
arithmetic. A group in the launch's last wave is spread (its blocks fold, and
combine, a share of the elements each); an earlier one is folded by its last
block alone. Integer counters (``counters``, zeros of the call's own,
``counter_count``) order them, and every sum runs in ascending order over
partials already written, so the bits do not depend on which block takes which
share. Blocks take their tasks from a ticket as they start, fold group by fold
group, a group's tasks in a row, so a block only waits for its own group or
earlier ones, never for a task behind one not yet taken.

``params`` (int32): ``B, Hkv, G, n, D, CHUNK, max_chunks, window``, optionally
the combine's ``sinks`` flag (``KernelBackend.attend``'s layout: the kernel
finds the sequences at ``len(params) - 5 * B``), then per sequence ``slot,
end, held, origin, wrap``. Queries may be f32, f16 or bf16 (``T``: rounded to
the K/V type for the mma, a copy when they are of it already; the output is
``T``); K/V f16 or bf16.
Within a chunk the arithmetic is fixed by position: four warps each take a
quarter of the chunk's keys (tiles of 16, ascending), each with its own online
softmax, combined warp 0..3 in order; P is rounded to the element type for the
P.V product and ``l`` sums exactly the rounded weights.

A block may take ``span`` consecutive chunks in turn (``SPANS``,
``span_for``), its copies running on into the next chunk's tiles while it
writes the last one's partial; each chunk's sums are the same whichever block
computes them.

Launch: ``grid = (128 * B * Hkv * ceil(max_chunks / span) * ceil(n*G / 16), 1,
1)`` (MLX counts threads), ``threadgroup = (128, 1, 1)``, ``shared_bytes(D,
span)`` of dynamic shared memory (74,496 at D = 128 and span 1: three blocks
per H100/H200 SM; 109,824 with a span: two; at most 168 registers a thread,
no spills, NVRTC sm_90a). The kernel text ships as
``*.cu``/``*.h`` in ``kernels/``: a wheel needs ``*.cu`` in the package data.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

import mlx.core as mx
import numpy as np

from muser_kv.core import attention
from muser_kv.core.attention import KeyRead

#: Threads per block (4 warps); must match muser_attend::THREADS.
THREADS = 128
#: Query rows per block (mma's M).
ROWS = 16
#: Head dims the kernel is built for (a template value: registers hold o).
HEAD_DIMS = (64, 128, 256)
INPUT_NAMES = ["queries", "keys", "values", "scale", "sinks", "params", "counters"]
OUTPUT_NAMES = ["out", "partials", "merged"]
#: Warps per block, keys per tile, cp.async ring depth (muser_attend::WARPS, TK, STAGES).
WARPS, TILE_KEYS, STAGES = 4, 16, 2
#: Chunks per fold (muser_attend::FOLD): the rule's ``attention.FOLD``.
FOLD = attention.FOLD


def shared_bytes(head_dim: int, span: int = 1) -> int:
    """Dynamic shared memory per block (muser_attend::smem_bytes): the Q tile,
    each warp's 2-stage K/V ring of 16-key tiles (rows padded to D + 8 halves),
    the combine's weights; with ``span`` > 1 each warp's (m, l, o) for the
    combine in a region of its own (the ring holds the next chunk's tiles)."""
    pitch = head_dim + 8
    scratch = WARPS * 4 * (2 * ROWS + ROWS * pitch) if span > 1 else 0
    return ROWS * pitch * 2 + WARPS * STAGES * 2 * TILE_KEYS * pitch * 2 + ROWS * 8 * 4 + scratch


def _text(name: str) -> str:
    try:
        return resources.files("muser_kv.kernel_sources").joinpath(name).read_text()
    except (FileNotFoundError, ModuleNotFoundError):  # pragma: no cover - a wheel without .cu
        return (Path(__file__).resolve().parents[2] / "kernels" / name).read_text()


def compact(text: str) -> str:
    """``text`` without its comments, blank lines and indentation, every other
    character kept: MLX builds a launch's whole source from the header at every
    call and hashes it at every evaluation, so each byte of it is host time in
    every layer of every step. An NVRTC error's line numbers count this text's
    lines. A text whose meaning the cut could change (a continued line followed
    by one it drops, a backslash before trailing blanks) is refused."""
    out: List[str] = []
    continued = False
    for number, line in enumerate(text.splitlines(), 1):
        code = line.strip()
        at = code.find("//")
        if at >= 0 and '"' not in code[:at]:  # a comment, not text inside a string
            code = code[:at].rstrip()
        if code.endswith("\\") and not line.endswith("\\"):
            raise ValueError(f"compact: line {number} would end in a backslash it does not end in")
        if continued and not code:
            raise ValueError(f"compact: line {number} continues a line and would be dropped")
        continued = code.endswith("\\")
        if code:
            out.append(code)
    return "\n".join(out) + "\n"


def kernel_source() -> str:
    return compact(_text("attend_mma.cu"))


def kernel_header() -> str:
    return compact(_text("attend_mma.h"))


def kernel_name(head_dim: int, span: int = 1) -> str:
    return f"muser_kv_attend_mma_d{head_dim}" + (f"_x{span}" if span > 1 else "")


_built: Dict[Tuple[int, int], Callable] = {}


def _kernel(head_dim: int, span: int) -> Callable:
    """One kernel object per (head_dim, span): its shared memory is fixed at build time."""
    if (head_dim, span) not in _built:
        _built[head_dim, span] = cast(Callable, mx.fast.cuda_kernel(
            name=kernel_name(head_dim, span), input_names=INPUT_NAMES, output_names=OUTPUT_NAMES,
            source=kernel_source(), header=kernel_header(), ensure_row_contiguous=False,
            shared_memory=shared_bytes(head_dim, span)))
    return _built[head_dim, span]


#: Chunks a block may take in turn (muser_attend's SPAN): divisors of FOLD, so
#: that a block's chunks lie in one fold group.
SPANS = (1, 2, 4, 8, 16)
#: A launch takes blocks of ``LONG_SPAN`` chunks when a sequence has at least
#: ``LONG_CHUNKS`` chunks and that grid keeps ``FULL_GRID`` blocks, else one
#: chunk a block; ``FULL_GRID`` 0: always one. The span moves no bit: every
#: chunk's partial is the same sums whichever block computes it. Off: on an
#: H100 one launch at 131k, B = 1, takes longer with any span than without
#: (fewer blocks stream longer), and decode over 52 layers slows at 131k
#: (docs/performance.md, "Decode attention").
LONG_SPAN, LONG_CHUNKS, FULL_GRID = 16, 128, 0


def span_for(batch: int, kv_heads: int, max_chunks: int, n_g: int) -> int:
    """The span a launch of this shape takes (``LONG_SPAN``, ``FULL_GRID``)."""
    if FULL_GRID and max_chunks >= LONG_CHUNKS and \
            launch_geometry(batch, kv_heads, max_chunks, n_g, LONG_SPAN)[2] >= FULL_GRID:
        return LONG_SPAN
    return 1


def launch_geometry(batch: int, kv_heads: int, max_chunks: int, n_g: int,
                    span: int = 1) -> Tuple[Tuple[int, int, int], Tuple[int, int, int], int]:
    """``(grid, threadgroup, blocks)``: MLX's grid counts threads; a block per
    (sequence, K/V head, ``span`` chunks, M tile)."""
    blocks = batch * kv_heads * -(-max_chunks // span) * (-(-n_g // ROWS))
    return (THREADS * blocks, 1, 1), (THREADS, 1, 1), blocks


@lru_cache(maxsize=None)
def most_chunks(head_dim: int) -> int:
    """The most chunks a sequence may have: the combine keeps a weight and a sum
    per fold and query row in the block's K/V rings, beside each row's offset,
    max and total (``fold_and_combine``: ``ring_floats``, ``TAIL_FIXED``)."""
    ring = WARPS * STAGES * 2 * TILE_KEYS * (head_dim + 8) * 2 // 4 - 4
    return (ring - 4 * ROWS) // (2 * ROWS) * FOLD


def counter_count(batch: int, kv_heads: int, max_chunks: int, n_g: int) -> int:
    """The zeros a launch counts in (``attend``, ``fold_and_combine``): the
    tasks' ticket, then per (sequence, K/V head, M tile) each fold group's
    written partials and folded shares, and the folds written."""
    return 1 + batch * kv_heads * -(-n_g // ROWS) * (2 * -(-max_chunks // FOLD) + 1)


def attend_mma(queries: mx.array, keys: mx.array, values: mx.array,
               params: Union[mx.array, Sequence[int]], scale: Union[float, mx.array],
               max_chunks: int, n_g: int, sinks: Optional[mx.array] = None,
               span: Optional[int] = None) -> Tuple[mx.array, mx.array]:
    """Decode attention, one launch: ``(out, partials)``, ``out`` ``[B, Hq, n,
    D]`` in the queries' dtype and the chunk partials ``[B, Hkv, max_chunks,
    n_g, D + 2]`` float32 it was combined from.

    ``queries`` ``[B, Hq, n, D]`` (f32, f16 or bf16, any strides),
    ``keys``/``values`` ``[S, Hkv, R, D]`` views of one type (f16 or bf16, any
    strides), ``params`` int32 as described in the module docstring (its D,
    n, G, max_chunks must agree with the shapes and arguments; ``max_chunks``
    at least every sequence's count; a 9-int header's flag set when ``sinks``
    are given), ``scale`` a float or a float32 ``[1]`` array, ``n_g = n * G``,
    ``sinks`` float32 ``[Hq]`` or ``None``; ``span``: chunks a block takes in
    turn (of ``SPANS``; ``None``: ``span_for``'s), which changes no bit."""
    b, hq, n, d = queries.shape
    kv_heads = keys.shape[1]
    if queries.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise ValueError(f"attend_mma: queries f32, f16 or bf16, got {queries.dtype}")
    if d not in HEAD_DIMS or keys.shape[3] != d or values.shape[3] != d:
        raise ValueError(f"attend_mma: head_dim {d} (keys {keys.shape[3]}), supported {HEAD_DIMS}")
    if hq % kv_heads or n_g != n * (hq // kv_heads) or max_chunks < 1:
        raise ValueError(f"attend_mma: n_g {n_g} != n * G for queries "
                         f"{tuple(queries.shape)} and {kv_heads} K/V heads")
    if not isinstance(params, mx.array):
        params = list(params)
        if len(params) - 5 * b == 9 and params[8] and sinks is None:
            raise ValueError("attend_mma: params ask for sinks (header [8]) and none are given")
        params = mx.array(params, dtype=mx.int32)
    if params.dtype != mx.int32:
        params = params.astype(mx.int32)
    if params.ndim != 1 or params.size - 5 * b not in (8, 9):
        raise ValueError(f"attend_mma: params of {params.size} ints for {b} sequences: "
                         f"a header of 8 or 9, then 5 per sequence")
    if not isinstance(scale, mx.array):
        scale = mx.array([scale], dtype=mx.float32)
    elif scale.dtype != mx.float32 or scale.size != 1:
        scale = scale.astype(mx.float32).reshape(1)
    if sinks is None:
        sinks = NO_SINKS
    elif sinks.dtype != mx.float32 or sinks.size != hq:
        raise ValueError(f"attend_mma: sinks float32 [{hq}], got {sinks.dtype} {tuple(sinks.shape)}")
    if span is not None and span not in SPANS:
        raise ValueError(f"attend_mma: span {span}, one of {SPANS}")
    return launch(queries, keys, values, params, scale, max_chunks, n_g, sinks, span)


def launch(queries: mx.array, keys: mx.array, values: mx.array, params: mx.array,
           scale: mx.array, max_chunks: int, n_g: int, sinks: mx.array,
           span: Optional[int] = None) -> Tuple[mx.array, mx.array]:
    """``attend_mma`` for arguments already in its checked form (``params``
    int32, ``scale`` float32 ``[1]``, ``sinks`` float32 ``[Hq]`` or
    ``NO_SINKS``), for a caller that built them (``KernelBackend.attend``):
    every layer of every step comes here, so it checks only what such a caller
    does not decide, the planes' type and the combine's room."""
    b, hq, n, d = queries.shape
    kv_heads = keys.shape[1]
    if keys.dtype not in (mx.float16, mx.bfloat16) or values.dtype != keys.dtype:
        raise ValueError(f"attend_mma: keys and values f16 or bf16 of one type, got "
                         f"{keys.dtype} and {values.dtype}")
    if max_chunks > most_chunks(d):
        raise ValueError(f"attend_mma: {max_chunks} chunks of {attention.CHUNK} keys; at head_dim "
                         f"{d} the combine takes at most {most_chunks(d)}")
    if span is None:
        span = span_for(b, kv_heads, max_chunks, n_g)
    groups = -(-max_chunks // FOLD)
    counters = _COUNTERS.take(counter_count(b, kv_heads, max_chunks, n_g))
    grid, threadgroup, _ = launch_geometry(b, kv_heads, max_chunks, n_g, span)
    out, partials, _ = _kernel(d, span)(
        inputs=[queries, keys, values, scale, sinks, params, counters],
        template=[("T", queries.dtype), ("P", keys.dtype), ("HD", d), ("SPAN", span)],
        grid=grid, threadgroup=threadgroup,
        output_shapes=[(b, hq, n, d), (b, kv_heads, max_chunks, n_g, d + 2),
                       (b, kv_heads, groups, n_g, d + 2)],
        output_dtypes=[queries.dtype, mx.float32, mx.float32],
    )
    return out, partials


#: The sinks input when there are none (unread: the params' flag is 0). Every
#: array kept between calls is made from host data, never a lazy op: MLX's
#: streams are per thread, and serve builds steps in threads other than the
#: one that made it ("There is no Stream(gpu, 0) in current thread").
NO_SINKS = mx.array([0.0], dtype=mx.float32)


class Counters:
    """Zeroed int32 counters for the launches' folds, cut from one zeroed array
    at a time: every launch counts in a slice of its own (no two launches, even
    ones MLX runs at once, share a counter), and the zeros are one fill per
    ``POOL`` counters rather than one more graph node per launch."""

    POOL = 1 << 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: Optional[mx.array] = None
        self._used = 0

    def take(self, n: int) -> mx.array:
        """``n`` counters, zero, used by nobody else."""
        if n > self.POOL:
            return mx.zeros((n,), dtype=mx.int32)
        with self._lock:
            if self._pool is None or self._used + n > self.POOL:
                # host zeros, not mx.zeros: the pool outlives the thread that made it
                self._pool, self._used = mx.array(np.zeros(self.POOL, np.int32)), 0
            start = self._used
            self._used += n
            return self._pool[start:start + n]


_COUNTERS = Counters()


def kernel_params(batch: int, kv_heads: int, group: int, queries: int, head_dim: int,
                  chunk: int, max_chunks: int, window: int,
                  sequences: Sequence[KeyRead], sinks: int = 0) -> mx.array:
    """The params array for ``sequences`` (``KeyRead``s), in
    ``KernelBackend.attend``'s layout (9-int header, ``sinks`` at [8]);
    ``window`` 0: none."""
    if chunk <= 0 or chunk % (WARPS * TILE_KEYS):
        raise ValueError(f"attend_mma: CHUNK {chunk} is not a multiple of {WARPS * TILE_KEYS}")
    out = [batch, kv_heads, group, queries, head_dim, chunk, max_chunks, window, sinks]
    for s in sequences:
        out += [s.slot, s.end, s.held, s.origin, s.wrap]
    return mx.array(out, dtype=mx.int32)


def combine_partials(partials: mx.array, queries: int, group: int, dtype: mx.Dtype) -> mx.array:
    """The second pass in plain MLX ops, for checking the first: partials
    ``[B, Hkv, C, n*G, D + 2]`` -> ``[B, Hkv*G, n, D]`` (``dtype``), chunks
    combined against their common max (a row that saw nothing gives 0)."""
    b, hkv, _, ng, w = partials.shape
    d = w - 2
    o, m, sums = partials[..., :d], partials[..., d], partials[..., d + 1]
    top = m.max(axis=2, keepdims=True)
    weight = mx.where(m == -mx.inf, 0.0, mx.exp(m - mx.where(top == -mx.inf, 0.0, top)))
    total = (weight * sums).sum(axis=2)
    out = (weight[..., None] * o).sum(axis=2)
    out = mx.where(total[..., None] > 0, out / mx.where(total > 0, total, 1.0)[..., None], 0.0)
    out = out.reshape(b, hkv, queries, group, d).transpose(0, 1, 3, 2, 4)
    return out.reshape(b, hkv * group, queries, d).astype(dtype)
