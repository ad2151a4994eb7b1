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
difference (or a kernel that fails to build or run) exits 1.

MLX compiles one program per kernel and set of template values, never per
shape or grid, and on CUDA that compile (NVRTC, on the host) is most of the
time. The kernels' only template values are their element types
(head geometry and layout are runtime ``params``), so there are 16 programs:
batch_store and stage 3 input types x 2 plane types each, gather and install 2
plane types each. The cases are grouped by that instantiation (kernel, input
type, plane type), each group built and evaluated at once (one compile) and
compared after, and the groups are spread over a few worker processes
(``--jobs``, ``default_jobs``), each compiling its own share. An MLX with
neither Metal nor CUDA has nothing to test: it says so and exits 0.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, TextIO, Tuple, Union

import mlx.core as mx
import numpy as np

from muser_kv.core import kernels
from muser_kv.core.geometry import allocated_rows
from muser_kv.core.kernel_cases import (
    ATTENTION_CASES,
    RING_STATES,
    STORE_CASES,
    model_kv,
    plane_buffer,
)
from muser_kv.core.kernels import HEAD_MAJOR, TOKEN_MAJOR, KernelBackend, ReferenceBackend
from muser_kv.core.ring import Ring

KERNELS = ("batch_store", "stage", "gather", "install")

INPUT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
PLANE_DTYPES = (mx.float16, mx.bfloat16)
# (kv_heads, head_dim): Muse Glimmer's, and one whose small inputs MLX passes in
# `constant` memory (fewer than 8 elements)
GEOMETRIES = ((2, 128), (1, 4))
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


Results = List[Tuple[str, mx.array, mx.array]]
#: One instantiation -- (kernel, input type or "", plane type): the template
#: values, hence the one program MLX compiles for its cases, whatever their head
#: geometry and layout (those are params). gather and install have no input type.
Group = Tuple[str, str, str]


@dataclass(frozen=True)
class Case:
    """One case: ``run`` returns (what, kernel result, reference result) triples,
    unevaluated. ``index`` is its place in the fixed order failures are reported in."""

    index: int
    kernel: str
    group: Group
    label: str
    run: Callable[[], Results]


@dataclass
class GroupResult:
    """What one instantiation's cases gave; failures carry their case's index."""

    kernel: str
    cases: int = 0
    elements: int = 0
    failures: List[Tuple[int, str]] = field(default_factory=list)


def cases(gpu: KernelBackend, ref: ReferenceBackend) -> List[Case]:
    """Every case, in report order."""
    out: List[Case] = []

    def add(kernel: str, group: Group, label: str, run: Callable[[], Results]) -> None:
        out.append(Case(len(out), kernel, group, label, run))

    for h, d in GEOMETRIES:
        for p in PLANE_DTYPES:
            for t in INPUT_DTYPES:
                for layout in (TOKEN_MAJOR, HEAD_MAJOR):
                    for i, case in enumerate(STORE_CASES):
                        kv_layout = INPUT_LAYOUTS[i % len(INPUT_LAYOUTS)]
                        label = (f"H={h} D={d} T={_name(t)} P={_name(p)} {layout} ring{case[:3]} "
                                 f"+{case[3]} {kv_layout}")
                        add("batch_store", ("batch_store", _name(t), _name(p)), label,
                            _store(gpu, ref, h, d, t, p, layout, case, kv_layout))
                        for rows in ("exact", "padded"):
                            add("stage", ("stage", _name(t), _name(p)),
                                f"{label} rows {rows}",
                                _stage(gpu, ref, h, d, t, p, layout, case, kv_layout, rows))
            for layout in (TOKEN_MAJOR, HEAD_MAJOR):
                for state in RING_STATES:
                    for rows in ("exact", "padded"):
                        label = f"H={h} D={d} P={_name(p)} {layout} ring{state} rows {rows}"
                        for kernel, run in (("gather", _gather), ("install", _install)):
                            add(kernel, (kernel, "", _name(p)), label,
                                run(gpu, ref, h, d, p, layout, state, rows))
    return out


def groups(all_cases: Sequence[Case]) -> Dict[Group, List[Case]]:
    """The cases by instantiation, in order of first appearance."""
    out: Dict[Group, List[Case]] = {}
    for case in all_cases:
        out.setdefault(case.group, []).append(case)
    return out


def _error(case: Case, e: BaseException) -> Tuple[int, str]:
    return case.index, f"{case.label}: {type(e).__name__}: {e}".splitlines()[0]


def _flatten(results: Results) -> List[mx.array]:
    return [a for _, got, expect in results for a in (got, expect)]


def check_group(group_cases: Sequence[Case]) -> GroupResult:
    """One instantiation's cases: all built, evaluated together (its kernel is
    compiled once, at the first evaluation), then compared bit for bit. A case
    that fails to build, or an evaluation that fails (a kernel that does not
    compile or run), fails; a failed evaluation is retried case by case so that
    each failure names its own case."""
    result = GroupResult(group_cases[0].kernel, cases=len(group_cases))
    built: List[Tuple[Case, Results]] = []
    for case in group_cases:
        try:
            built.append((case, case.run()))
        except Exception as e:  # a kernel that cannot even be called is a failure
            result.failures.append(_error(case, e))
    try:
        mx.eval([a for _, results in built for a in _flatten(results)])
    except Exception:
        evaluated = []
        for case, results in built:
            try:
                mx.eval(_flatten(results))
            except Exception as e:
                result.failures.append(_error(case, e))
                continue
            evaluated.append((case, results))
        built = evaluated
    for case, results in built:
        for what, got, expect in results:
            result.elements += got.size
            diff = _difference(what, got, expect)
            if diff:
                result.failures.append((case.index, f"{case.label}: {diff}"))
                break
    return result


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
        k, v = model_kv(n, t, n + length, kv_layout, h, d), model_kv(n, t, n + length + 1, kv_layout, h, d)
        got_k, got_v, dest = gpu.store_with_dest(k, v, layout, first, count, r, start, p)
        ref_k, ref_v = ref.store(k, v, layout, first, count, dtype=p)
        expect = mx.array([r.physical(start + first + j) for j in range(count)], mx.int32)
        return [("key rows", got_k, ref_k), ("value rows", got_v, ref_v), ("dest", dest, expect)]
    return run


def _stage(gpu, ref, h, d, t, p, layout, case, kv_layout, rows):
    def run():
        capacity, length, origin, n = case
        r = _ring(capacity, length, origin)
        planes = plane_buffer(layout, _rows(capacity, rows), p, length, h, d)
        k, v = model_kv(n, t, 3, kv_layout, h, d), model_kv(n, t, 4, kv_layout, h, d)
        got, expect = gpu.stage(*planes, r, k, v, layout), ref.stage(*planes, r, k, v, layout)
        return [("key shadow", got[0], expect[0]), ("value shadow", got[1], expect[1])]
    return run


def _gather(gpu, ref, h, d, p, layout, state, rows):
    def run():
        r = _ring(*state)
        planes = plane_buffer(layout, _rows(state[0], rows), p, state[1] + state[2], h, d)
        got, expect = gpu.gather(*planes, layout, r), ref.gather(*planes, layout, r)
        return [("key snapshot", got[0], expect[0]), ("value snapshot", got[1], expect[1])]
    return run


def _install(gpu, ref, h, d, p, layout, state, rows):
    def run():
        r = _ring(*state)
        planes = plane_buffer(layout, _rows(state[0], rows), p, 7, h, d)
        logical = ref.gather(*planes, layout, r)
        shape = tuple(planes[0].shape)
        got = gpu.install(*logical, layout, r, shape)
        expect = ref.install(*logical, layout, r, shape)
        return [("key plane", got[0], expect[0]), ("value plane", got[1], expect[1])]
    return run


def _merge(results: Sequence[GroupResult], selected: Sequence[str]) -> List[KernelReport]:
    reports = {k: KernelReport(k) for k in selected}
    failures: Dict[str, List[Tuple[int, str]]] = {k: [] for k in selected}
    for r in results:
        reports[r.kernel].cases += r.cases
        reports[r.kernel].elements += r.elements
        failures[r.kernel] += r.failures
    for k, report in reports.items():
        report.failures = [text for _, text in sorted(failures[k])]
    return [reports[k] for k in selected]


class _Progress:
    """Cases done, on stderr: tqdm's bar where tqdm is installed (the ``lm``
    extra), else one line per finished kernel instantiation."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.enabled, self.total, self.done = enabled, total, 0
        if enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs shipped
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="case", desc="selftest", file=sys.stderr,
                            mininterval=0.5, leave=False)

    def update(self, result: GroupResult, group: Group) -> None:
        self.done += result.cases
        if self.bar is not None:
            self.bar.update(result.cases)
        elif self.enabled:
            print(f"selftest: {self.done}/{self.total} cases ({' '.join(map(str, group))})",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- worker processes: each builds the case list itself and checks the
# instantiations it is handed, so each kernel program is compiled in one process

_WORKER: Dict[str, Dict[Group, List[Case]]] = {}


def _worker_init(initializer: Optional[Callable[[], None]]) -> None:
    if initializer is not None:
        initializer()


def _worker_check(backend: str, device: str, group: Group) -> GroupResult:
    if backend not in _WORKER:
        _WORKER[backend] = groups(cases(KernelBackend(backend), ReferenceBackend()))
    with mx.stream(mx.gpu if device == "gpu" else mx.cpu):
        return check_group(_WORKER[backend][group])


def default_jobs(instantiations: int) -> int:
    """Worker processes for ``instantiations`` groups: about their square root,
    at most one per CPU this process may use (4 for the 16 programs).

    Each worker pays a process start, an MLX import and a GPU context, each group
    one compile. The start-ups, not the compiles, dominate when the workers
    contend for the CPUs (docs/performance.md, the selftest). With start-up ``s`` per worker and compile ``c`` per
    group, ``j`` workers take about ``s*j + c*n/j``, least at ``j = sqrt(c*n/s)``:
    ``sqrt(n)`` where ``s`` is about ``c``."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = max(1, len(affinity(0)) if affinity else (os.cpu_count() or 1))
    return max(1, min(cpus, math.isqrt(max(1, instantiations) - 1) + 1))  # ceil(sqrt(n))


def run_checks(gpu: KernelBackend, device: Union[mx.Device, mx.DeviceType],
               ref: Optional[ReferenceBackend] = None, *, jobs: int = 1,
               kernels_to_check: Sequence[str] = KERNELS, progress: bool = False,
               initializer: Optional[Callable[[], None]] = None) -> List[KernelReport]:
    """Every case of ``kernels_to_check`` on ``device`` (the GPU, or the CPU for an
    emulated backend), one instantiation at a time; one report per kernel.

    ``jobs > 1`` spreads the instantiations over that many fresh (spawned)
    processes, which rebuild the backend by name (``initializer``, picklable,
    runs first in each: the tests install the Metal emulator with it); ``gpu``
    and ``ref`` must then be the plain backends, whatever a subclass would
    change could not reach them."""
    unknown = [k for k in kernels_to_check if k not in KERNELS]
    if unknown or not kernels_to_check:
        raise ValueError(f"kernels_to_check must name some of {KERNELS}, got {list(kernels_to_check)}")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    selected = [k for k in KERNELS if k in kernels_to_check]
    todo = {g: c for g, c in groups(cases(gpu, ref or ReferenceBackend())).items()
            if g[0] in selected}
    bar = _Progress(sum(len(c) for c in todo.values()), progress)
    results: List[GroupResult] = []
    try:
        if jobs == 1:
            with mx.stream(device):
                for group, group_cases in todo.items():
                    results.append(check_group(group_cases))
                    bar.update(results[-1], group)
        else:
            results = _run_parallel(gpu, ref, device, todo, jobs, bar, initializer)
    finally:
        bar.close()
    return _merge(results, selected)


def _run_parallel(gpu: KernelBackend, ref: Optional[ReferenceBackend],
                  device: Union[mx.Device, mx.DeviceType], todo: Dict[Group, List[Case]],
                  jobs: int, bar: _Progress,
                  initializer: Optional[Callable[[], None]]) -> List[GroupResult]:
    if type(gpu) is not KernelBackend or (ref is not None and type(ref) is not ReferenceBackend):
        raise ValueError(f"jobs > 1 rebuilds the backends by name in each worker: got "
                         f"{type(gpu).__name__} and {type(ref).__name__}, expected KernelBackend "
                         "and ReferenceBackend (or jobs=1)")
    device_type = getattr(device, "type", device)
    where = "gpu" if device_type == mx.gpu else "cpu"
    results: List[GroupResult] = []
    # spawn, not fork: a forked child of a process that has touched the GPU
    # cannot use it
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)),
                             mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_init, initargs=(initializer,)) as pool:
        # the largest groups first, so that no worker is left with one at the end
        futures = {pool.submit(_worker_check, gpu.name, where, g): g
                   for g in sorted(todo, key=lambda g: -len(todo[g]))}
        for future in as_completed(futures):
            group = futures[future]
            try:
                result = future.result()
            except Exception as e:  # the worker itself failed: every case of it fails
                result = GroupResult(group[0], cases=len(todo[group]), failures=[
                    (c.index, f"{c.label}: worker failed: {type(e).__name__}: {e}".splitlines()[0])
                    for c in todo[group]])
            results.append(result)
            bar.update(result, group)
    return results


def check_attention(gpu: ReferenceBackend, ref: ReferenceBackend, heads: int = 32,
                    kv_heads: int = 2) -> KernelReport:
    """Decode attention (``core.attention``) on ``ATTENTION_CASES``, for both
    plane types: the same bits under every placement of a sequence's keys (a
    rotated token-major ring, another slot of a padded plane, beside another
    sequence), and the reference within rounding (another summation order)."""
    from muser_kv.core.attention import DecodeRead, KeyRead

    report = KernelReport("attend")
    rng = np.random.default_rng(0)
    for end, held, n, window, d in ATTENTION_CASES:
        for p in PLANE_DTYPES:
            label = f"attend end {end} held {held} n {n} window {window} d {d} {_name(p)}"
            k_log = rng.standard_normal((kv_heads, held, d)).astype(np.float32)
            v_log = rng.standard_normal((kv_heads, held, d)).astype(np.float32)
            q = mx.array(rng.standard_normal((1, heads, n, d)).astype(np.float32)).astype(p)
            outs = []
            for rows, origin, slots, slot, token_major in (
                    (held, 0, 1, 0, False), (held + 256, held // 3, 1, 0, True),
                    (held + 1, 1, 3, 2, False)):
                planes = []
                for x in (k_log, v_log):
                    a = np.full((slots, kv_heads, rows, d), np.nan, np.float32)
                    a[slot][:, (origin + np.arange(held)) % rows] = x
                    arr = mx.array(a).astype(p)
                    if token_major:
                        arr = mx.contiguous(arr.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                    planes.append(arr)
                read = DecodeRead(planes[0], planes[1], (KeyRead(slot, end, held, origin, rows),),
                                  window or None)
                outs.append((gpu.attend(q, read, d ** -0.5), read))
            report.cases += 1
            report.elements += outs[0][0].size
            first = _bits(outs[0][0])
            if any(not np.array_equal(_bits(o), first) for o, _ in outs[1:]):
                report.failures.append(f"{label}: other bits under another placement")
                continue
            want = np.array(ref.attend(q, outs[0][1], d ** -0.5).astype(mx.float32))
            got = np.array(outs[0][0].astype(mx.float32))
            if not np.all(np.isfinite(got)) or np.max(np.abs(got - want)) > 2e-2:
                report.failures.append(f"{label}: max |difference| from the reference "
                                       f"{float(np.max(np.abs(got - want))):.3g}")
    return report


def _device_name() -> str:
    try:
        return str(mx.device_info().get("device_name", "unknown device"))
    except Exception:  # informative only
        return "unknown device"


def main(backend: Optional[str] = None, out: Optional[TextIO] = None,
         jobs: Optional[int] = None) -> int:
    """Print one line per kernel and the time taken; 0 when all are bitwise equal
    to the reference, 1 on any difference, 0 with "nothing to test" when this MLX
    has no GPU backend. ``jobs``: worker processes (default ``default_jobs`` of
    the number of kernel programs; 1 checks in this process), progress on stderr."""
    began = time.perf_counter()
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
    gpu = KernelBackend(name)
    programs = len(groups(cases(gpu, ReferenceBackend())))
    jobs = default_jobs(programs) if jobs is None else jobs
    print(f"muser-kv selftest: mlx {version}, {name} kernels on {_device_name()} "
          f"against the reference path on the same GPU ({programs} kernel programs, {jobs} "
          f"{'process' if jobs == 1 else 'processes'})", file=out, flush=True)
    reports = run_checks(gpu, mx.gpu, jobs=jobs, progress=True)
    with mx.stream(mx.gpu):
        attend = check_attention(gpu, ReferenceBackend())
    return summarize(reports, name, out, seconds=time.perf_counter() - began, attend=attend)


def summarize(reports: Sequence[KernelReport], name: str, out: Optional[TextIO] = None,
              seconds: Optional[float] = None, attend: Optional[KernelReport] = None) -> int:
    """One line per kernel and the verdict (with the time taken, when given);
    the exit status (0 or 1). ``attend``: the decode attention's report
    (``check_attention``), its own line."""
    out = out or sys.stdout
    took = "" if seconds is None else f" in {seconds:.1f} s"
    for report in reports:
        print(report.line(), file=out)
    bad = [r.kernel for r in reports if not r.ok]
    if attend is not None:
        if attend.ok:
            print(f"{'attend':<12} ok    {attend.cases} cases, {attend.elements:,} elements, the "
                  "same bits under every placement, the reference within rounding", file=out)
        else:
            print(attend.line(), file=out)
            bad.append("attend")
    if bad:
        verb = "differs" if len(bad) == 1 else "differ"
        print(f"selftest FAILED: {', '.join(bad)} {verb} from the reference path{took}",
              file=out)
        return 1
    print(f"selftest passed: all {len(reports)} kernels bitwise equal to the reference path "
          f"({name}){took}", file=out)
    return 0
