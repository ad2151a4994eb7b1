"""How rows move: the data path between the model's K/V and the planes.

Every operation here is a copy plus at most one conversion to the plane type
(f16 or bf16, round to nearest even), so every backend must give the same bits:

* ``reference``: plain MLX ops; runs on any MLX device and is the oracle;
* ``metal`` / ``cuda``: the kernel bodies in ``kernels/`` built once with
  ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` (one body, one prelude).

Positions never reach this module as positions: the ring hands over its
reservation (origins, counts, runs) and the functions move the rows they are
told to move. No kernel writes memory it does not declare as an output (MLX
orders GPU work only by declared outputs), so kernels produce what is new --
rows in the plane's layout, a staging shadow, a snapshot, a fresh plane -- and
``place`` puts rows into a plane with MLX's own donated update.
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import resources
from typing import Callable, Dict, Optional, Sequence, Tuple, Union, cast

import mlx.core as mx
import numpy as np

from muser_kv.core import attention, attention_cuda
from muser_kv.core.ring import Ring, Run

#: The production encoding; bf16 planes serve models whose attention runs in bf16.
PLANE_DTYPE = mx.float16
PLANE_DTYPES = (mx.float16, mx.bfloat16)
INPUT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

TOKEN_MAJOR = "token_major"
HEAD_MAJOR = "head_major"

BACKEND_ENV = "MUSER_KV_BACKEND"
BACKENDS = ("reference", "metal", "cuda")
THREADGROUP = 256

Pair = Tuple[mx.array, mx.array]


# -- layout helpers shared by every backend ----------------------------------


def attention_view(rows: mx.array, layout: str, kv_heads: int, head_dim: int) -> mx.array:
    """Rows in either layout as the ``[1, H, L, D]`` view attention reads.

    Token-major rows become a strided view (strides ``L*H*D, D, H*D, 1``) that
    ``scaled_dot_product_attention`` reads without a copy."""
    if layout == TOKEN_MAJOR:
        n = rows.shape[0]
        return rows.reshape(1, n, kv_heads, head_dim).transpose(0, 2, 1, 3)
    return rows[None]


def physical_view(plane: mx.array, layout: str) -> mx.array:
    """An attention-shaped plane ``[1, H, R, D]`` as the rows the kernels index:
    ``[R, H*D]`` token-major or ``[H, R, D]`` head-major (views of the same buffer;
    ``R`` is the allocation, which may exceed the ring's capacity)."""
    if layout == TOKEN_MAJOR:
        _, h, c, d = plane.shape
        return plane.transpose(0, 2, 1, 3).reshape(c, h * d)
    return plane.squeeze(0)


def host_rows(physical: np.ndarray, layout: str, at: int, m: int, head_dim: int) -> np.ndarray:
    """Physical rows ``at .. at + m`` of a host view of ``physical_view``'s form
    (``[R, H*D]`` or ``[H, R, D]``) as ``[m, H, D]``: a view, so the host reads
    a plane's rows from it and writes them through it (a save, a placed load)."""
    if layout == TOKEN_MAJOR:
        rows = physical[at:at + m]
        if not rows.flags.c_contiguous:  # its reshape would be a copy: writes would be lost
            raise ValueError(f"a token-major plane's host view must be C-contiguous, "
                             f"got strides {physical.strides}")
        return rows.reshape(m, -1, head_dim)
    return physical[:, at:at + m, :].transpose(1, 0, 2)


def place(plane: mx.array, rows: mx.array, runs: Sequence[Run], layout: str,
          slot: Optional[int] = None) -> mx.array:
    """``plane`` (attention-shaped, ``[S, H, C, D]``) with ``rows`` (in the
    plane's layout) written along ``runs`` of slot ``slot`` (``None``: the only
    one, ``S == 1``); returns the new plane.

    The one placement mechanism of every plane: MLX's slice update, which reuses
    the plane's buffer when MLX can donate it (O(rows)) and copies it otherwise;
    either way MLX tracks the write, so no reader can race it. A donated buffer
    keeps its strides, so a token-major plane stays token-major in memory."""
    _, h, capacity, d = plane.shape
    for run in runs:
        src = slice(run.source, run.source + run.length)
        update = rows[src] if layout == TOKEN_MAJOR else rows[:, src, :]
        if slot is not None:
            dst = slice(run.physical, run.physical + run.length)
            plane[slot:slot + 1, :, dst, :] = attention_view(update, layout, h, d)
            continue
        if run.length == capacity:
            # MLX answers a slice update that covers the whole array with the
            # update itself, strides and all; the plane must stay in its layout's
            # memory order because the kernels index it as such.
            plane = attention_view(mx.contiguous(update), layout, h, d)
            continue
        dst = slice(run.physical, run.physical + run.length)
        plane[:, :, dst, :] = attention_view(update, layout, h, d)
    return plane


def _rows_shape(layout: str, count: int, kv_heads: int, head_dim: int) -> Tuple[int, ...]:
    if layout == TOKEN_MAJOR:
        return (count, kv_heads * head_dim)
    return (kv_heads, count, head_dim)


def allocated_rows(plane_rows: mx.array, layout: str) -> int:
    """Rows a plane (as ``physical_view`` gives it) allocates."""
    return plane_rows.shape[0] if layout == TOKEN_MAJOR else plane_rows.shape[1]


# -- the reference path --------------------------------------------------------


class ReferenceBackend:
    """Plain MLX ops. Same outputs, bit for bit, as the kernels."""

    name = "reference"
    #: the most query tokens per sequence ``attend`` takes: any, on the CPU
    #: (where a token's bits must not depend on how its request was chunked);
    #: ``MAX_QUERIES`` on a GPU, where a prefill chunk keeps MLX's attention
    max_queries = 1 << 30

    def store(self, keys: mx.array, values: mx.array, layout: str, first: int, count: int,
              ring: Optional[Ring] = None, start: int = 0, dtype: mx.Dtype = PLANE_DTYPE) -> Pair:
        """Model-shaped ``[1, H, N, D]`` K/V -> rows of the plane type ``dtype``,
        ``first .. first+count``, in the plane's layout (``[count, H*D]`` or ``[H, count, D]``).

        ``ring`` (the reservation, after ``append_batch``) and ``start`` (the
        chunk's first position) let a kernel also compute each row's physical
        destination on the device; placement itself uses the ring's runs."""
        return (self._rows(keys, layout, first, count, dtype),
                self._rows(values, layout, first, count, dtype))

    @staticmethod
    def _rows(x: mx.array, layout: str, first: int, count: int, dtype: mx.Dtype) -> mx.array:
        # Views only (slice, squeeze, transpose, reshape) around one conversion:
        # an input of the plane's type reaches the slice update with no kernel of its own.
        if first or count != x.shape[2]:
            x = x[:, :, first:first + count, :]
        x = x.astype(dtype).squeeze(0)
        if layout == HEAD_MAJOR:
            return x
        h, n, d = x.shape
        if n == 1:
            return x.reshape(1, h * d)  # one token: head-major order is token order
        return x.transpose(1, 0, 2).reshape(n, h * d)

    def stage(self, ring_keys: mx.array, ring_values: mx.array, ring: Ring,
              keys: mx.array, values: mx.array, layout: str = TOKEN_MAJOR) -> Pair:
        """The staging shadow ``[len + N, H*D]`` (token-major whatever the ring's
        layout) in the ring's type: live ring rows in logical order, then the chunk's rows."""
        old_k, old_v = self.gather(ring_keys, ring_values, layout, ring)
        n, dtype = keys.shape[2], ring_keys.dtype
        return (mx.concatenate([old_k, self._rows(keys, TOKEN_MAJOR, 0, n, dtype)], axis=0),
                mx.concatenate([old_v, self._rows(values, TOKEN_MAJOR, 0, n, dtype)], axis=0))

    def gather(self, plane_keys: mx.array, plane_values: mx.array, layout: str, ring: Ring) -> Pair:
        """The live rows in logical order as ``[len, H*D]`` (token order), in fresh
        buffers: a snapshot must never alias a plane, or it would block MLX from
        donating the plane to the next store."""
        runs = ring.live_runs()
        out = []
        for plane in (plane_keys, plane_values):
            if layout == TOKEN_MAJOR or plane.shape[0] == 1 or not runs:
                # a whole run of a token-major plane, or of one head transposed,
                # is no copy: take copies
                index = (mx.concatenate([mx.arange(r.physical, r.physical + r.length,
                                                   dtype=mx.int32) for r in runs])
                         if runs else mx.zeros((0,), mx.int32))
                if layout == TOKEN_MAJOR:
                    out.append(mx.take(plane, index, axis=0))
                else:
                    h, _, d = plane.shape
                    out.append(mx.take(plane, index, axis=1).transpose(1, 0, 2)
                               .reshape(-1, h * d))
                continue
            h, _, d = plane.shape
            # one strided copy per run (take, then transpose, would copy twice)
            parts = [plane[:, r.physical:r.physical + r.length, :].transpose(1, 0, 2)
                     for r in runs]
            rows = mx.contiguous(parts[0]) if len(parts) == 1 else mx.concatenate(parts, axis=0)
            out.append(rows.reshape(-1, h * d))
        return out[0], out[1]

    def install(self, rows_keys: mx.array, rows_values: mx.array, layout: str, ring: Ring,
                shape: Tuple[int, ...]) -> Pair:
        """A fresh plane of ``shape`` (rows >= the ring's extent: a preallocated
        plane's capacity rounded up, or a growing plane's allocation) in the rows'
        type, holding ``[n, H*D]`` logical rows at rotation ``ring.origin_physical``
        and zeros elsewhere. Built in physical order from its pieces, so every
        byte is written once (a zero-filled plane placed into is written twice)."""
        axis = 0 if layout == TOKEN_MAJOR else 1
        total = shape[axis]
        runs = sorted(ring.live_runs(), key=lambda r: r.physical)
        out = []
        for rows in (rows_keys, rows_values):
            if layout == HEAD_MAJOR:
                rows = rows.reshape(rows.shape[0], shape[0], shape[2]).transpose(1, 0, 2)
            pieces, at = [], 0
            for run in runs + [Run(total, 0, 0)]:
                if run.physical > at:
                    gap = list(shape)
                    gap[axis] = run.physical - at
                    pieces.append(mx.zeros(gap, rows.dtype))
                if run.length:
                    src = slice(run.source, run.source + run.length)
                    pieces.append(rows[src] if axis == 0 else rows[:, src, :])
                at = run.physical + run.length
            plane = mx.concatenate(pieces, axis=axis) if len(pieces) > 1 else mx.contiguous(pieces[0])
            out.append(plane)
        return out[0], out[1]


    def attend(self, queries: mx.array, read: attention.DecodeRead, scale: float,
               sinks: Optional[mx.array] = None) -> mx.array:
        """Decode attention over ``read`` (``core.attention``): its reference."""
        return attention.reference(queries, read, scale, sinks)


# -- the kernel path -----------------------------------------------------------

_KERNELS = {
    # name: (input names, output names)
    "batch_store": (["key", "value", "params"], ["key_rows", "value_rows", "dest"]),
    "stage": (["ring_key", "ring_value", "key", "value", "params"], ["shadow_key", "shadow_value"]),
    "gather": (["plane_key", "plane_value", "params"], ["out_key", "out_value"]),
    "install": (["rows_key", "rows_value", "params"], ["plane_key", "plane_value"]),
    "attend": (["queries", "keys", "values", "scale", "params"], ["partials"]),
    "attend_merge": (["partials", "params", "fold"], ["merged"]),
    "attend_combine": (["partials", "sinks", "params", "fold"], ["out"]),
}


def kernel_source(name: str) -> str:
    """The prelude followed by one kernel body, exactly as every backend compiles it."""
    src = resources.files("muser_kv.kernel_sources")
    return src.joinpath("prelude.h").read_text() + "\n" + src.joinpath(f"{name}.inc").read_text()


def kernel_header() -> str:
    """The file-scope helpers every kernel shares (``convert.h``): each factory's ``header``."""
    return resources.files("muser_kv.kernel_sources").joinpath("convert.h").read_text()


def _params(*values: int) -> mx.array:
    return mx.array(values, dtype=mx.int32)


def _geometry(kv_heads: int, head_dim: int, layout: str) -> Tuple[int, int, int]:
    """The last three ``params`` of every kernel: ``kv_heads, head_dim, head_major``."""
    return kv_heads, head_dim, int(layout == HEAD_MAJOR)


def _grid(threads: int) -> Tuple[int, int, int]:
    # A multiple of the threadgroup: Metal and CUDA then launch the same threads.
    return (max(1, -(-threads // THREADGROUP)) * THREADGROUP, 1, 1)


class KernelBackend(ReferenceBackend):
    """The kernel bodies through ``mx.fast.metal_kernel`` or ``mx.fast.cuda_kernel``.
    Each kernel is built once, and its only template values are the element
    types (input ``T``, plane ``P``): positions, head geometry and layout travel
    in ``params`` (``_geometry`` appends the last three), so MLX compiles one
    program per kernel and type pair, whatever the geometry, layout or shape
    (Metal's text also varies with which inputs have fewer than 8 elements:
    MLX passes those in ``constant`` memory)."""

    max_queries = attention.MAX_QUERIES

    def __init__(self, name: str):
        if name not in ("metal", "cuda"):
            raise ValueError(f"no kernel backend {name!r}")
        self.name = name
        self._built: Dict[str, Callable] = {}
        self._constants: Dict[tuple, mx.array] = {}

    def kernel(self, name: str) -> Callable:
        if name not in self._built:
            inputs, outputs = _KERNELS[name]
            factory = mx.fast.metal_kernel if self.name == "metal" else mx.fast.cuda_kernel
            # mlx's stubs type the built kernel as ``object``; it is the callable
            # its documentation describes
            self._built[name] = cast(Callable, factory(
                name=f"muser_kv_{name}", input_names=inputs, output_names=outputs,
                source=kernel_source(name), header=kernel_header(), ensure_row_contiguous=False,
            ))
        return self._built[name]

    def store(self, keys, values, layout, first, count, ring=None, start=0, dtype=PLANE_DTYPE):
        if keys.dtype == dtype:
            # Nothing to convert: MLX's slice update copies the (strided) rows
            # straight into the plane, one dispatch per plane; a kernel would add one.
            return super().store(keys, values, layout, first, count, dtype=dtype)
        # The destinations are how the selftest and the kernel tests check the
        # device's ring arithmetic against Ring's; a store needs only the rows,
        # and one kernel with ``count`` int32 words more costs less than a
        # second program per type pair to compile and check.
        return self.store_with_dest(keys, values, layout, first, count, ring, start, dtype)[:2]

    def store_with_dest(self, keys, values, layout, first, count, ring=None, start=0,
                        dtype=PLANE_DTYPE):
        """``store`` plus each row's physical destination, translated on the device
        from the ring's explicit origins."""
        _, h, _, d = keys.shape
        shape = _rows_shape(layout, count, h, d)
        ring = ring or Ring(max(count, 1))
        return self.kernel("batch_store")(
            inputs=[keys, values, _params(first, count, start, ring.capacity,
                                          ring.origin_logical, ring.origin_physical,
                                          *_geometry(h, d, layout))],
            template=[("T", keys.dtype), ("P", dtype)],
            grid=_grid(count * h * d), threadgroup=(THREADGROUP, 1, 1),
            output_shapes=[shape, shape, (count,)],
            output_dtypes=[dtype, dtype, mx.int32],
        )

    def stage(self, ring_keys, ring_values, ring, keys, values, layout=TOKEN_MAJOR):
        _, h, n, d = keys.shape
        rows, dtype = ring.len + n, ring_keys.dtype
        return tuple(self.kernel("stage")(
            inputs=[mx.contiguous(ring_keys), mx.contiguous(ring_values), keys, values,
                    _params(ring.len, ring.origin_physical, ring.capacity, n,
                            allocated_rows(ring_keys, layout), *_geometry(h, d, layout))],
            template=[("T", keys.dtype), ("P", dtype)],
            grid=_grid(rows * h * d), threadgroup=(THREADGROUP, 1, 1),
            output_shapes=[(rows, h * d)] * 2, output_dtypes=[dtype] * 2,
        ))

    def gather(self, plane_keys, plane_values, layout, ring):
        rows = allocated_rows(plane_keys, layout)
        kv_dim = plane_keys.size // rows
        head_dim = plane_keys.shape[-1]
        if ring.len == 0:
            return super().gather(plane_keys, plane_values, layout, ring)
        return tuple(self.kernel("gather")(
            inputs=[mx.contiguous(plane_keys), mx.contiguous(plane_values),
                    _params(ring.len, ring.origin_physical, ring.capacity, rows,
                            *_geometry(kv_dim // head_dim, head_dim, layout))],
            template=[("P", plane_keys.dtype)],
            grid=_grid(ring.len * kv_dim), threadgroup=(THREADGROUP, 1, 1),
            output_shapes=[(ring.len, kv_dim)] * 2, output_dtypes=[plane_keys.dtype] * 2,
        ))

    def install(self, rows_keys, rows_values, layout, ring, shape):
        head_dim = shape[-1]
        kv_dim = rows_keys.shape[1]
        rows = shape[0] if layout == TOKEN_MAJOR else shape[1]
        return tuple(self.kernel("install")(
            inputs=[mx.contiguous(rows_keys), mx.contiguous(rows_values),
                    _params(ring.len, ring.origin_physical, ring.capacity, rows,
                            *_geometry(kv_dim // head_dim, head_dim, layout))],
            template=[("P", rows_keys.dtype)],
            grid=_grid(rows * kv_dim), threadgroup=(THREADGROUP, 1, 1),
            output_shapes=[shape] * 2, output_dtypes=[rows_keys.dtype] * 2,
        ))


    def attend(self, queries, read, scale, sinks=None):
        """Decode attention over ``read`` (``core.attention``'s rule). On CUDA one
        launch on the tensor cores (``attention_cuda.attend_mma``: the chunks'
        partials, folded and combined by the same blocks). Elsewhere the chunks'
        partials (``attend``), folded ``attention.FOLD`` at a time
        (``attend_merge``), then combined (``attend_combine``); a sequence
        folds to itself bit for bit when it has one group and no sinks, so the
        fold is skipped then. The K/V views go as they lie (their strides with
        them): no copy."""
        b, hq, n, d = attention.check_queries(queries, read)
        hkv = read.keys.shape[1]
        g = hq // hkv
        sequences, chunks = attention.kernel_params(read.sequences, n, read.window)
        params = self._small((b, hkv, g, n, d, attention.CHUNK, chunks, read.window or 0,
                              int(sinks is not None), *sequences))
        scale_ = self._small(float(scale))
        logits = None if sinks is None else sinks.astype(mx.float32)
        if self.name == "cuda" and d in attention_cuda.HEAD_DIMS:  # on the tensor cores
            return attention_cuda.launch(queries, read.keys, read.values, params, scale_, chunks,
                                         n * g, attention_cuda.NO_SINKS if logits is None else logits)[0]
        partials = self.kernel("attend")(
            inputs=[queries, read.keys, read.values, scale_, params],
            template=[("T", queries.dtype), ("P", read.keys.dtype)],
            grid=_grid(b * hkv * chunks * n * g * (-(-d // 32))),
            threadgroup=(THREADGROUP, 1, 1),
            output_shapes=[(b, hkv, chunks, n * g, d + 2)], output_dtypes=[mx.float32],
        )[0]
        return self.combine(partials, params, n, queries.dtype, logits,
                            fold=chunks > attention.FOLD or sinks is not None)

    def combine(self, partials: mx.array, params: mx.array, queries: int, dtype: mx.Dtype,
                sinks: Optional[mx.array] = None, fold: bool = True) -> mx.array:
        """The second half of decode attention over chunk partials ``[B, Hkv, C,
        n*G, D + 2]`` (``attend``'s params, ``queries`` = n): folded
        ``attention.FOLD`` at a time (``attend_merge``; skip it, ``fold=False``,
        only where it is exact: one group and no sinks), then combined
        (``attend_combine``) into ``[B, Hkv*G, n, D]`` of ``dtype``."""
        b, hkv, chunks, rows, width = partials.shape
        g, d = rows // queries, width - 2
        layout = self._small((1, chunks, 0))
        if fold:
            groups = -(-chunks // attention.FOLD)
            partials = self.kernel("attend_merge")(
                inputs=[partials, params, self._small((attention.FOLD, groups, chunks))],
                grid=_grid(b * hkv * groups * rows * width), threadgroup=(THREADGROUP, 1, 1),
                output_shapes=[(b, hkv, groups, rows, width)], output_dtypes=[mx.float32],
            )[0]
            layout = self._small((attention.FOLD, groups, 0))
        return self.kernel("attend_combine")(
            inputs=[partials, self._small(0.0) if sinks is None else sinks, params, layout],
            template=[("T", dtype)],
            grid=_grid(b * hkv * g * queries * d), threadgroup=(THREADGROUP, 1, 1),
            output_shapes=[(b, hkv * g, queries, d)], output_dtypes=[dtype],
        )[0]

    def _small(self, values: Union[float, Tuple[int, ...]]) -> mx.array:
        """A small constant input (int32 params, or one f32), made once per value
        and reused: every layer of a kind in a step hands the same params, and
        each array made from a list is a copy to the device."""
        key = values if isinstance(values, tuple) else ("f32", values)
        arrays = self._constants
        found = arrays.get(key)
        if found is None:
            if len(arrays) >= 64:  # the last few steps' values: older ones are done
                arrays.clear()
            found = arrays[key] = (mx.array([values], mx.float32) if isinstance(values, float)
                                   else mx.array(values, mx.int32))
        return found


# -- selection -------------------------------------------------------------------


def detect() -> str:
    """The best backend this MLX can run: Metal, then CUDA, else the reference.
    Never Metal without ``mx.metal`` (Linux): there, ``MUSER_KV_BACKEND=metal``
    fails at the first kernel with MLX's "No Metal back-end" (the tests' emulator
    can stand in for ``mx.fast.metal_kernel``: ``pytest --metal-emulator``)."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "reference"


@lru_cache(maxsize=None)
def _make(name: str) -> ReferenceBackend:
    return ReferenceBackend() if name == "reference" else KernelBackend(name)


def get_backend(name: Optional[str] = None) -> ReferenceBackend:
    """The backend named, else ``$MUSER_KV_BACKEND``, else the detected one.
    Each is built once and shared."""
    name = name or os.environ.get(BACKEND_ENV) or detect()
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {name!r}")
    return _make(name)
