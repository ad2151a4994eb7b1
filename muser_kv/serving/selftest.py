"""``muser-kv selftest``: every kernel built on this machine's GPU and checked, bit
for bit, against the reference path on the same device.

For users on Apple silicon (Metal) and NVIDIA GPUs (CUDA): each kernel is built
with ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` through the package's own
``KernelBackend`` and run on edge inputs -- f16/bf16 rounding ties, +-65504 and
overflow, subnormals, -0, NaN (payloads and signs), infinities -- for both
layouts, rings that wrap and chunks wider than the ring, f32/f16/bf16 K/V,
f16 and bf16 planes, padded allocations, contiguous, transposed and offset
inputs, and a head geometry small enough for MLX's `constant` memory. The
reference path runs the same operations in plain MLX on the same device, so
the device's own conversions apply to both sides. One line per kernel; any
difference (or a kernel that fails to build or run) exits 1. An MLX with
neither Metal nor CUDA has nothing to test: it says so and exits 0.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, TextIO, Tuple, Union

import mlx.core as mx
import numpy as np

from muser_kv.core import kernels
from muser_kv.core.geometry import allocated_rows
from muser_kv.core.kernels import HEAD_MAJOR, TOKEN_MAJOR, KernelBackend, ReferenceBackend
from muser_kv.core.ring import Ring

KERNELS = ("batch_store", "stage", "gather", "install")

# f32 edges: ties to even for f16 and bf16, the largest finite f16 and what
# rounds past it, f32's largest, f16 and bf16 subnormals, signed zeros, NaN, inf
F32_EDGES = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 65504.0,
             -65504.0, 65519.0, 65520.0, -65520.0, 3.4e38, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25,
             2.0 ** -133, 1e-45, -0.0, 0.0, float("nan"), -float("nan"), float("inf"),
             -float("inf")]
# raw 16-bit patterns: signed zeros, subnormals, largest finite, infinities,
# quiet and signalling NaNs with payloads, both signs
EDGE_BITS = {
    mx.float16: [0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x3C00, 0x3C01, 0x7BFF, 0xFBFF, 0x7C00,
                 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x7FFF, 0xFD01],
    mx.bfloat16: [0x0000, 0x8000, 0x0001, 0x007F, 0x8001, 0x3F80, 0x3F81, 0x477F, 0x4780, 0x7F7F,
                  0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC0, 0x7FFF, 0xFFA1],
}
INPUT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
PLANE_DTYPES = (mx.float16, mx.bfloat16)
# (kv_heads, head_dim): Muse Glimmer's, and one whose small inputs MLX passes in
# `constant` memory (fewer than 8 elements)
GEOMETRIES = ((2, 128), (1, 4))
# (capacity, live rows, origin, chunk): empty, wraps, full and wrapped, wider than the ring
STORE_CASES = ((16, 0, 0, 5), (16, 14, 0, 5), (16, 16, 9, 16), (16, 5, 0, 37), (16, 16, 3, 40),
               (4, 3, 0, 1))
RING_STATES = ((16, 5, 0), (16, 16, 0), (16, 16, 11), (16, 16, 37), (4, 1, 0))
INPUT_LAYOUTS = ("strided", "contiguous", "offset")


@dataclass
class KernelReport:
    """What one kernel's cases gave."""

    kernel: str
    cases: int = 0
    elements: int = 0
    failures: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.cases > 0 and not self.failures

    def line(self) -> str:
        if self.ok:
            return (f"{self.kernel:<12} ok    {self.cases} cases, {self.elements:,} elements "
                    "bitwise equal to the reference path")
        if not self.cases:
            return f"{self.kernel:<12} FAIL  no case ran"
        return (f"{self.kernel:<12} FAIL  {len(self.failures)} of {self.cases} cases differ; "
                f"first: {self.failures[0]}")


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]


def _edges(shape: Tuple[int, ...], dtype: mx.Dtype, seed: int) -> mx.array:
    """Random values of ``dtype`` with its edge cases at every third element
    (raw bit patterns for f16 / bf16: no conversion makes them)."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(shape) * 8).astype(np.float32)
    if dtype == mx.float32:
        flat = base.reshape(-1)
        flat[::3] = np.resize(np.array(F32_EDGES, np.float32), flat[::3].size)
        return mx.array(base)
    bits = np.array(mx.array(base, mx.float32).astype(dtype).view(mx.uint16)).reshape(-1)
    bits[::3] = np.resize(np.array(EDGE_BITS[dtype], np.uint16), bits[::3].size)
    return mx.array(bits.reshape(shape)).view(dtype)


def _kv(n: int, dtype: mx.Dtype, seed: int, layout: str, h: int, d: int) -> mx.array:
    """Model-shaped ``[1, h, n, d]`` K or V: the model's transposed view of
    ``[1, n, h, d]``, a row-major array, or a slice at an offset into a buffer."""
    if layout == "strided":
        return _edges((1, n, h, d), dtype, seed).transpose(0, 2, 1, 3)
    if layout == "offset":
        return _edges((1, h, n + 3, d), dtype, seed)[:, :, 3:, :]
    return _edges((1, h, n, d), dtype, seed)


def _planes(layout: str, rows: int, dtype: mx.Dtype, seed: int, h: int,
            d: int) -> Tuple[mx.array, mx.array]:
    shape = (rows, h * d) if layout == TOKEN_MAJOR else (h, rows, d)
    return _edges(shape, dtype, seed), _edges(shape, dtype, seed + 1)


def _bits(x: mx.array) -> np.ndarray:
    if x.dtype in (mx.float16, mx.bfloat16):
        return np.array(x.view(mx.uint16))
    return np.array(x)


def _difference(name: str, got: mx.array, expect: mx.array) -> Optional[str]:
    if got.dtype != expect.dtype or tuple(got.shape) != tuple(expect.shape):
        return (f"{name}: kernel {_name(got.dtype)} {tuple(got.shape)}, reference "
                f"{_name(expect.dtype)} {tuple(expect.shape)}")
    a, b = _bits(got), _bits(expect)
    bad = np.argwhere(a != b)
    if not bad.size:
        return None
    first = tuple(int(i) for i in bad[0])
    return (f"{name}: {len(bad):,} of {a.size:,} elements, first {list(first)}: kernel "
            f"{int(a[first]):#06x}, reference {int(b[first]):#06x}")


Check = Tuple[str, str, Callable[[], List[Tuple[str, mx.array, mx.array]]]]


def checks(gpu: KernelBackend, ref: ReferenceBackend) -> Iterator[Check]:
    """(kernel, case label, run) for every case; ``run`` returns (what, kernel
    result, reference result) triples."""
    for h, d in GEOMETRIES:
        for p in PLANE_DTYPES:
            for t in INPUT_DTYPES:
                for layout in (TOKEN_MAJOR, HEAD_MAJOR):
                    for i, case in enumerate(STORE_CASES):
                        kv_layout = INPUT_LAYOUTS[i % len(INPUT_LAYOUTS)]
                        label = (f"H={h} D={d} T={_name(t)} P={_name(p)} {layout} ring{case[:3]} "
                                 f"+{case[3]} {kv_layout}")
                        yield "batch_store", label, _store(gpu, ref, h, d, t, p, layout, case, kv_layout)
                        for rows in ("exact", "padded"):
                            yield ("stage", f"{label} rows {rows}",
                                   _stage(gpu, ref, h, d, t, p, layout, case, kv_layout, rows))
            for layout in (TOKEN_MAJOR, HEAD_MAJOR):
                for state in RING_STATES:
                    for rows in ("exact", "padded"):
                        label = f"H={h} D={d} P={_name(p)} {layout} ring{state} rows {rows}"
                        yield "gather", label, _gather(gpu, ref, h, d, p, layout, state, rows)
                        yield "install", label, _install(gpu, ref, h, d, p, layout, state, rows)


def _ring(capacity: int, length: int, origin: int) -> Ring:
    return Ring.installed(capacity, origin, length)


def _rows(capacity: int, rows: str) -> int:
    return capacity if rows == "exact" else allocated_rows(capacity)


def _store(gpu, ref, h, d, t, p, layout, case, kv_layout):
    def run():
        capacity, length, origin, n = case
        r = _ring(capacity, length, origin)
        start = r.end
        first, count = r.append_batch(start, n)
        k, v = _kv(n, t, n + length, kv_layout, h, d), _kv(n, t, n + length + 1, kv_layout, h, d)
        got_k, got_v, dest = gpu.store_with_dest(k, v, layout, first, count, r, start, p)
        ref_k, ref_v = ref.store(k, v, layout, first, count, dtype=p)
        expect = mx.array([r.physical(start + first + j) for j in range(count)], mx.int32)
        return [("key rows", got_k, ref_k), ("value rows", got_v, ref_v), ("dest", dest, expect)]
    return run


def _stage(gpu, ref, h, d, t, p, layout, case, kv_layout, rows):
    def run():
        capacity, length, origin, n = case
        r = _ring(capacity, length, origin)
        planes = _planes(layout, _rows(capacity, rows), p, length, h, d)
        k, v = _kv(n, t, 3, kv_layout, h, d), _kv(n, t, 4, kv_layout, h, d)
        got, expect = gpu.stage(*planes, r, k, v, layout), ref.stage(*planes, r, k, v, layout)
        return [("key shadow", got[0], expect[0]), ("value shadow", got[1], expect[1])]
    return run


def _gather(gpu, ref, h, d, p, layout, state, rows):
    def run():
        r = _ring(*state)
        planes = _planes(layout, _rows(state[0], rows), p, state[1] + state[2], h, d)
        got, expect = gpu.gather(*planes, layout, r), ref.gather(*planes, layout, r)
        return [("key snapshot", got[0], expect[0]), ("value snapshot", got[1], expect[1])]
    return run


def _install(gpu, ref, h, d, p, layout, state, rows):
    def run():
        r = _ring(*state)
        planes = _planes(layout, _rows(state[0], rows), p, 7, h, d)
        logical = ref.gather(*planes, layout, r)
        shape = tuple(planes[0].shape)
        got = gpu.install(*logical, layout, r, shape)
        expect = ref.install(*logical, layout, r, shape)
        return [("key plane", got[0], expect[0]), ("value plane", got[1], expect[1])]
    return run


def run_checks(gpu: KernelBackend, device: Union[mx.Device, mx.DeviceType],
               ref: Optional[ReferenceBackend] = None) -> List[KernelReport]:
    """Every case on ``device`` (the GPU, or the CPU for an emulated backend)."""
    ref = ref or ReferenceBackend()
    reports = {k: KernelReport(k) for k in KERNELS}
    with mx.stream(device):
        for kernel, label, run in checks(gpu, ref):
            report = reports[kernel]
            report.cases += 1
            try:
                results = run()
                mx.eval([a for _, a, b in results] + [b for _, a, b in results])
            except Exception as e:  # a kernel that does not build or run is a failure
                report.failures.append(f"{label}: {type(e).__name__}: {e}".splitlines()[0])
                continue
            for what, got, expect in results:
                report.elements += got.size
                diff = _difference(what, got, expect)
                if diff:
                    report.failures.append(f"{label}: {diff}")
                    break
    return [reports[k] for k in KERNELS]


def _device_name() -> str:
    try:
        return str(mx.device_info().get("device_name", "unknown device"))
    except Exception:  # informative only
        return "unknown device"


def main(backend: Optional[str] = None, out: Optional[TextIO] = None) -> int:
    """Print one line per kernel; 0 when all are bitwise equal to the reference,
    1 on any difference, 0 with "nothing to test" when this MLX has no GPU backend."""
    out = out or sys.stdout
    version = mx.__version__  # type: ignore[attr-defined]  # mlx's stubs omit mlx.core.__version__
    name = backend or kernels.detect()
    if name == "reference":
        print("muser-kv selftest: this MLX has neither Metal nor CUDA "
              f"(mlx {version}, {_device_name()}): nothing to test; the reference "
              "path is the only backend here", file=out)
        return 0
    available = {"metal": mx.metal.is_available(), "cuda": mx.cuda.is_available()}
    if not available.get(name, False):
        print(f"muser-kv selftest: backend {name!r} is not available in this MLX "
              f"(metal: {available['metal']}, cuda: {available['cuda']})", file=out)
        return 2
    print(f"muser-kv selftest: mlx {version}, {name} kernels on {_device_name()} "
          "against the reference path on the same GPU", file=out)
    return summarize(run_checks(KernelBackend(name), mx.gpu), name, out)


def summarize(reports: Sequence[KernelReport], name: str, out: Optional[TextIO] = None) -> int:
    """One line per kernel and the verdict; the exit status (0 or 1)."""
    out = out or sys.stdout
    for report in reports:
        print(report.line(), file=out)
    bad = [r.kernel for r in reports if not r.ok]
    if bad:
        verb = "differs" if len(bad) == 1 else "differ"
        print(f"selftest FAILED: {', '.join(bad)} {verb} from the reference path", file=out)
        return 1
    print(f"selftest passed: all {len(reports)} kernels bitwise equal to the reference path "
          f"({name})", file=out)
    return 0
