"""An emulated ``mx.fast.metal_kernel``: MLX's own Metal text, compiled by
clang++ behind the MSL shim (``tests/msl``) with strict warnings fatal, and run
on the CPU over the whole grid.

``EmulatedMetal`` has the factory's signature; the kernels it returns have a
Metal kernel's call signature. A call:

1. obtains the text MLX generates for exactly this call (``metal_text``:
   MLX prints it under ``mx.export_function`` tracing), checks its attributes
   and its parameters against MLX's buffer order;
2. compiles MLX's JIT preamble (the part the shim models) + that text + a
   driver that calls the kernel once per grid thread, as one C++ translation
   unit, twice (``tests/msl/metal_stdlib`` says why): the check build models
   MSL -- address spaces, scalar half/bfloat, no double -- with every strict
   warning fatal; the run build, the library executed, erases the address
   spaces and uses MLX's own CPU half/bfloat, so conversions give MLX CPU's
   bits (both cached by content);
3. runs it twice over the whole grid, in MLX's buffer order with each input's
   own strides and offset (what Metal is handed with ensure_row_contiguous=False),
   every buffer behind guard pages (``guarded``), inputs read-only:
   run A forward over outputs filled with 0x00, data flush against the upper
   guard; run B in reverse over outputs filled with 0xFF, data flush against
   the lower guard. Any fault, any write into a canary, or any difference
   between A and B (an element no thread writes, a read of memory no view
   covers, a thread-order dependence) raises;
4. returns A's outputs as MLX arrays, for the caller to compare bitwise.

MLX only, the CPU: Metal kernels never run here; this is for tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import metal_text
import mlx.core as mx
import numpy as np
from guarded import Placement, acquire
from metal_text import Param, Signature

SHIM_DIR = Path(__file__).parent / "msl"
#: MLX's own factory, taken before anything can replace it with an emulator.
REAL_METAL_KERNEL = mx.fast.metal_kernel
CLANG_ENV = "MUSER_KV_CLANG"
REQUIRE_ENV = "MUSER_KV_REQUIRE_CLANG"  # set by .ci/run: no clang is a failure there
MIN_CLANG = 17  # __bf16 as an arithmetic type on x86-64
MAX_THREADS_PER_THREADGROUP = 1024  # Apple GPUs' maxTotalThreadsPerThreadgroup, at most

#: The check build: MSL's model (address spaces, scalar half/bfloat, no double),
#: every strict diagnostic fatal. Unknown attributes are tolerated because clang
#: knows none of MSL's; ``metal_text.check_attributes`` checks them by name.
CHECK = ("-std=c++14", "-fsyntax-only", "-Werror", "-Wall", "-Wextra", "-Wpedantic",
         "-Wconversion", "-Wsign-conversion", "-Wshorten-64-to-32", "-Wshadow-all", "-Wundef",
         "-Wdouble-promotion", "-Wfloat-conversion", "-Wvla", "-Wcast-qual",
         "-Wimplicit-fallthrough", "-Wno-unknown-attributes")
#: The run build: the same text, address spaces erased, MLX's CPU half/bfloat.
RUN_FLAGS = ("-std=c++14", "-O1", "-fPIC", "-DMUSER_KV_MSL_RUN", "-w")
#: Linked without the C runtime's start files (a kernel library needs none) and
#: with gold where it exists: the link was most of a kernel's build time.
#: -z defs: a symbol these libraries do not provide fails the link, not the load.
LINK = (("-fuse-ld=gold",) if shutil.which("ld.gold") else ()) + (
    "-shared", "-nostdlib", "-Wl,-z,defs")
LIBS = ("-lstdc++", "-lm", "-lc")
RUN = RUN_FLAGS + ("-fvisibility=hidden",) + LINK


class MetalEmulatorError(RuntimeError):
    """The emulated Metal kernel failed a check (compile, bounds or determinism)."""


class ClangMissing(MetalEmulatorError):
    pass


class MetalCompileError(MetalEmulatorError):
    pass


class MetalFault(MetalEmulatorError):
    """An access outside a buffer, or a write to an input."""


class MetalRunMismatch(MetalEmulatorError):
    """The two runs (fills 0x00/0xFF, forward/reverse) disagree."""


# -- the compiler -------------------------------------------------------------------

def find_clang() -> str:
    """``$MUSER_KV_CLANG``, else clang++-19, else a clang++ of version >= 17."""
    candidates = [os.environ[CLANG_ENV]] if os.environ.get(CLANG_ENV) else ["clang++-19", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if not path:
            continue
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"clang version (\d+)", out)
        if m and int(m.group(1)) >= MIN_CLANG:
            return path
    raise ClangMissing(f"no clang++ >= {MIN_CLANG} found (tried {candidates}); "
                       "Debian: apt-get install clang-19")


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


class Compiler:
    """clang++ with the shim; builds the runtime object once and each kernel
    library on demand, all cached on disk by content."""

    def __init__(self, clang: Optional[str] = None):
        self.clang = clang or find_clang()
        self.version = subprocess.run([self.clang, "--version"], capture_output=True,
                                      text=True).stdout.splitlines()[0]
        self.dir = Path(tempfile.gettempdir()) / "muser_kv_msl"
        self.dir.mkdir(exist_ok=True)
        self.preamble = metal_text.jit_preamble()
        shim = (SHIM_DIR / "metal_stdlib").read_text()
        runtime = (SHIM_DIR / "runtime.cpp").read_text()
        types = metal_text.mlx_include_root() / "mlx" / "types"
        mlx_types = "".join((types / n).read_text() for n in ("fp16.h", "bf16.h"))
        # the paths too: a precompiled header records the absolute include paths
        # it was built with, and another checkout's (since deleted) would not load
        self.base = _digest(self.version, shim, runtime, mlx_types, self.preamble, CHECK, RUN,
                            str(SHIM_DIR), str(metal_text.mlx_include_root()))
        self.include = self.dir / f"include_{self.base}"
        self.include.mkdir(exist_ok=True)
        header = self.include / "mlx_jit_preamble.h"
        if not header.exists():  # content-addressed: rewriting it would stale the PCH
            tmp = header.with_name(f"{header.name}.{os.getpid()}.tmp")
            tmp.write_text(self.preamble)
            tmp.replace(header)
        self.runtime = self._build(self.dir / f"runtime_{self.base}.o", [
            self.clang, "-std=c++17", "-O2", "-fPIC", "-c", str(SHIM_DIR / "runtime.cpp")],
            "runtime.cpp")
        self.check_includes = ["-isystem", str(SHIM_DIR), "-include",
                               str(self.include / "mlx_jit_preamble.h")]
        run_includes = ["-isystem", str(SHIM_DIR), "-isystem", str(metal_text.mlx_include_root())]
        # the run build's preamble (MLX's CPU half/bfloat and the C++ headers they
        # pull in) precompiled once: most of a kernel's compile time otherwise
        self.pch = self.dir / f"preamble_run_{self.base}.pch"
        self.pch_command = [self.clang, *RUN_FLAGS, *run_includes, "-x", "c++-header",
                            str(self.include / "mlx_jit_preamble.h")]
        self._build(self.pch, self.pch_command, "MLX's preamble (run build)")
        self.run_includes = run_includes + ["-include-pch", str(self.pch)]

    def _build(self, target: Path, command: List[str], what: str) -> Path:
        if target.exists():
            return target
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        proc = subprocess.run(command + ["-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise MetalCompileError(f"clang++ rejected {what}:\n{proc.stderr[:6000]}")
        tmp.replace(target)
        return target

    def translation_unit(self, text: str, signature: Signature) -> str:
        """MLX's text (instantiation attributes removed) and the driver; both
        builds prepend MLX's preamble (``-include`` / its precompiled form)."""
        return (f'#line 1 "{signature.name}.metal"\n' + metal_text.for_clang(text)
                + '\n#line 1 "muser_kv_emulator_driver.cpp"\n' + driver(signature))

    def library(self, text: str, signature: Signature) -> Path:
        """The kernel library for MLX's ``text``: the check build (every strict
        warning fatal; ``MetalCompileError`` carries clang's diagnostics) and the
        run build of the same translation unit, side by side; the library is
        kept (and cached) only when both pass."""
        tu = self.translation_unit(text, signature)
        key = _digest(self.base, tu)
        target = self.dir / f"kernel_{key}.so"
        if target.exists():
            return target
        src = self.dir / f"kernel_{key}.cpp"
        written = src.with_name(f"{src.name}.{os.getpid()}.tmp")
        written.write_text(tu)
        written.replace(src)  # whole: another test process may be compiling it
        what = f"the Metal text of {signature.name} ({src})"
        for attempt in range(2):
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            check = subprocess.Popen([self.clang, *CHECK, *self.check_includes, str(src)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            run = subprocess.run([self.clang, *RUN, *self.run_includes, str(src), str(self.runtime),
                                  *LIBS, "-o", str(tmp)], capture_output=True, text=True)
            diagnostics = check.communicate()[0]
            if check.returncode != 0 or diagnostics.strip():
                tmp.unlink(missing_ok=True)
                raise MetalCompileError(f"clang++ rejected {what}:\n{diagnostics[:6000]}")
            if run.returncode == 0:
                tmp.replace(target)
                return target
            tmp.unlink(missing_ok=True)
            stale = "precompiled header" in run.stderr or "AST file" in run.stderr
            if attempt or not stale:
                raise MetalCompileError(f"clang++ rejected {what} (run build):\n{run.stderr[:6000]}")
            self.pch.unlink(missing_ok=True)  # stale (its header was rewritten): rebuild once
            self._build(self.pch, self.pch_command, "MLX's preamble (run build)")
        raise AssertionError("unreachable")


# -- the driver: one call of the kernel per grid thread --------------------------------

_ATTRIBUTE_VALUES = {
    "thread_position_in_grid": "position",
    "threads_per_grid": "grid",
    "grid_size": "grid",
    "grid_origin": "origin",
    "threads_per_threadgroup": "group",
    "dispatch_threads_per_threadgroup": "group",
    "thread_position_in_threadgroup": "local",
    "threadgroup_position_in_grid": "group_position",
    "threadgroups_per_grid": "groups",
    "thread_index_in_threadgroup": "local_index",
}


def _argument(p: Param, index: int) -> str:
    if p.kind == "attribute":
        if p.name not in _ATTRIBUTE_VALUES:
            raise MetalEmulatorError(f"the emulator does not model the attribute [[{p.name}]]")
        return _ATTRIBUTE_VALUES[p.name]
    const = "" if p.kind == "output" else "const "
    pointer = f"({const}{p.space} {p.ctype}*)L.buffers[{index}]"
    return f"*{pointer}" if p.ref else pointer


def driver(sig: Signature) -> str:
    """C++ that calls ``sig``'s kernel once per thread of the grid, forward or
    in reverse, with Metal's thread attributes computed from the position."""
    args = []
    index = 0
    for p in sig.params:
        args.append(_argument(p, index))
        index += p.buffer is not None
    call = f"{sig.name}{sig.template_args}(\n        " + ",\n        ".join(args) + ");"
    return f"""
namespace {{
struct MuserKvLaunch {{
  void* const* buffers;
  uint32_t grid_dims[3];
  uint32_t group_dims[3];
  int32_t reverse;
}};

uint3 muser_kv_uint3(uint32_t x, uint32_t y, uint32_t z) {{
  uint3 v;
  v.x = x;
  v.y = y;
  v.z = z;
  return v;
}}

void muser_kv_grid(const void* arg) {{
  const MuserKvLaunch& L = *static_cast<const MuserKvLaunch*>(arg);
  const uint32_t gx = L.grid_dims[0], gy = L.grid_dims[1], gz = L.grid_dims[2];
  const uint32_t tx = L.group_dims[0], ty = L.group_dims[1], tz = L.group_dims[2];
  const uint3 grid = muser_kv_uint3(gx, gy, gz);
  const uint3 origin = muser_kv_uint3(0u, 0u, 0u);
  const uint3 group = muser_kv_uint3(tx, ty, tz);
  const uint3 groups = muser_kv_uint3((gx + tx - 1u) / tx, (gy + ty - 1u) / ty, (gz + tz - 1u) / tz);
  const uint64_t count = (uint64_t)gx * gy * gz;
  (void)grid; (void)origin; (void)group; (void)groups;
  for (uint64_t i = 0; i < count; ++i) {{
    const uint64_t t = L.reverse ? count - 1u - i : i;
    const uint32_t x = (uint32_t)(t % gx);
    const uint32_t y = (uint32_t)((t / gx) % gy);
    const uint32_t z = (uint32_t)(t / ((uint64_t)gx * gy));
    const uint3 position = muser_kv_uint3(x, y, z);
    const uint3 local = muser_kv_uint3(x % tx, y % ty, z % tz);
    const uint3 group_position = muser_kv_uint3(x / tx, y / ty, z / tz);
    const uint local_index = local.x + local.y * tx + local.z * tx * ty;
    (void)position; (void)local; (void)group_position; (void)local_index;
    {call}
  }}
}}
}}  // namespace

extern "C" int muser_kv_guarded(void (*run)(const void*), const void* launch, void* fault);

extern "C" __attribute__((visibility("default"))) int muser_kv_emulate(
    void* const* buffers, const uint32_t* dims, int32_t reverse, void* fault) {{
  const MuserKvLaunch launch = {{buffers, {{dims[0], dims[1], dims[2]}}, {{dims[3], dims[4], dims[5]}},
                                 reverse}};
  return muser_kv_guarded(muser_kv_grid, &launch, fault);
}}
"""


class _Fault(ctypes.Structure):
    _fields_ = [("address", ctypes.c_uint64), ("signal", ctypes.c_int32), ("write", ctypes.c_int32)]


# -- host views of MLX arrays ----------------------------------------------------------

_NUMPY = {mx.float16: np.float16, mx.float32: np.float32, mx.bfloat16: np.uint16,
          mx.int32: np.int32, mx.uint32: np.uint32, mx.int64: np.int64, mx.uint64: np.uint64,
          mx.int16: np.int16, mx.uint16: np.uint16, mx.int8: np.int8, mx.uint8: np.uint8,
          mx.bool_: np.bool_}


def host_view(a: mx.array) -> np.ndarray:
    """The (evaluated) array's memory as MLX holds it -- its data pointer
    (offset included) and its strides -- as a numpy view; bf16 as uint16 bits."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=False)


def _extent(v: np.ndarray) -> Tuple[int, int]:
    """(lo, hi): the byte range around v's data pointer that its elements cover."""
    if v.size == 0:
        return 0, 0
    lo = sum(min(0, (n - 1) * s) for n, s in zip(v.shape, v.strides))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(v.shape, v.strides)) + v.itemsize
    return lo, hi


def _bytes(a: np.ndarray) -> np.ndarray:
    """Each element's bytes as one row."""
    return a.reshape(-1).view(np.uint8).reshape(a.size, a.itemsize)


def _to_mlx(data: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(data)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


# -- the emulated factory and kernels ------------------------------------------------------

@dataclass
class Call:
    """One emulated call, for coverage checks."""

    kernel: str  # the name given to the factory
    function: str  # the generated function's name
    key: tuple
    inputs: Tuple[Tuple[str, str, str], ...]  # (name, dtype, address space) in MLX's order


@dataclass
class Compiled:
    signature: Signature
    text: str
    library: ctypes.CDLL
    plans: Dict[tuple, "Plan"] = field(default_factory=dict)

    @property
    def inputs(self) -> Tuple[Tuple[str, str, str], ...]:
        return tuple((p.name, p.ctype, p.space) for p in self.signature.params if p.kind == "input")

    def plan(self, views: Sequence[np.ndarray], outputs) -> "Plan":
        key = (tuple((v.shape, v.strides, v.dtype.str) for v in views), outputs)
        if key not in self.plans:
            self.plans[key] = make_plan(self.signature, views, outputs)
        return self.plans[key]


class EmulatedMetal:
    """Stands in for ``mx.fast.metal_kernel``. ``real`` is MLX's own factory,
    used only to obtain the generated text."""

    def __init__(self, compiler: Optional[Compiler] = None, real=None):
        self.compiler = compiler or Compiler()
        self.real = real or REAL_METAL_KERNEL
        self.texts: Dict[tuple, str] = {}
        self.compiled: Dict[str, Compiled] = {}
        self.calls: List[Call] = []

    def __call__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options=None) -> "EmulatedKernel":
        if ensure_row_contiguous or atomic_outputs or compile_options is not None:
            raise MetalEmulatorError(
                f"{name}: the emulator models ensure_row_contiguous=False, no atomic outputs "
                "and default compile options (what muser-kv asks for)")
        return EmulatedKernel(self, name, list(input_names), list(output_names), source, header)

    def text(self, kernel: "EmulatedKernel", inputs, output_shapes, output_dtypes, grid,
             threadgroup, template) -> Tuple[tuple, str]:
        key = metal_text.text_key(kernel.name, kernel.input_names, kernel.output_names,
                                  kernel.source, kernel.header, False, inputs, output_dtypes,
                                  template)
        if key not in self.texts:
            self.texts[key] = metal_text.generated_source(
                self.real, kernel.name, kernel.input_names, kernel.output_names, kernel.source,
                kernel.header, False, inputs, output_shapes, output_dtypes, grid, threadgroup,
                template)
        return key, self.texts[key]

    def compile(self, text: str, kernel: "EmulatedKernel") -> Compiled:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest not in self.compiled:
            metal_text.check_attributes(text)
            sig = metal_text.parse_signature(text, kernel.input_names, kernel.output_names)
            lib = ctypes.CDLL(str(self.compiler.library(text, sig)))
            lib.muser_kv_emulate.restype = ctypes.c_int
            lib.muser_kv_emulate.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                             ctypes.POINTER(ctypes.c_uint32), ctypes.c_int32,
                                             ctypes.POINTER(_Fault)]
            lib.muser_kv_prepare.restype = lib.muser_kv_finish.restype = ctypes.c_int
            lib.muser_kv_prepare.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
            lib.muser_kv_finish.argtypes = [ctypes.c_void_p, ctypes.c_int32]
            self.compiled[digest] = Compiled(sig, text, lib)
        return self.compiled[digest]


#: Serializes emulated launches (see ``EmulatedKernel.__call__``).
_LAUNCH = threading.RLock()


@dataclass
class EmulatedKernel:
    emulator: EmulatedMetal
    name: str
    input_names: List[str]
    output_names: List[str]
    source: str
    header: str
    last_text: str = field(default="", repr=False)

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None) -> List[mx.array]:
        # One launch at a time, as one GPU queue runs them: the guarded arenas are
        # reused between launches and the fault handler is process-wide, so two
        # threads emulating at once (sessions saved from several threads) would
        # fault each other's guard pages.
        with _LAUNCH:
            return self._launch(inputs, output_shapes, output_dtypes, grid, threadgroup,
                                template, init_value, verbose)

    def _launch(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template,
                init_value, verbose) -> List[mx.array]:
        if init_value is not None:
            raise MetalEmulatorError(f"{self.name}: init_value is not emulated")
        template = list(template or [])
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        key, text = self.emulator.text(self, inputs, output_shapes, output_dtypes, grid,
                                       threadgroup, template)
        self.last_text = text
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```")
        compiled = self.emulator.compile(text, self)
        if threadgroup[0] * threadgroup[1] * threadgroup[2] > MAX_THREADS_PER_THREADGROUP:
            raise MetalEmulatorError(f"{self.name}: threadgroup {threadgroup} exceeds "
                                     f"{MAX_THREADS_PER_THREADGROUP} threads")
        mx.eval(inputs)
        views = [host_view(x) for x in inputs]
        outputs = tuple((tuple(s), d) for s, d in zip(output_shapes, output_dtypes))
        plan = compiled.plan(views, outputs)
        group = tuple(min(t, g) for t, g in zip(threadgroup, grid))
        dims = (ctypes.c_uint32 * 6)(*grid, *group)
        run_a = _run(compiled, plan, views, dims, Placement.END, 0x00, 0x5A, reverse=False)
        run_b = _run(compiled, plan, views, dims, Placement.START, 0xFF, 0xA5, reverse=True)
        for name, a, b in zip(self.output_names, run_a, run_b):
            if a.tobytes() != b.tobytes():
                differ = np.any(_bytes(a) != _bytes(b), axis=1)
                raise MetalRunMismatch(
                    f"{compiled.signature.name}: output `{name}` differs between run A (0x00 fill, "
                    f"forward) and run B (0xFF fill, reverse) at {int(differ.sum())} of {a.size} "
                    f"elements (first: flat index {int(np.argmax(differ))}): an element no thread "
                    "writes, a read outside every input view, or a thread-order dependence")
        self.emulator.calls.append(Call(self.name, compiled.signature.name, key, compiled.inputs))
        return [_to_mlx(a, d) for a, (_, d) in zip(run_a, outputs)]


@dataclass
class Plan:
    """What each buffer of a run holds, in MLX's buffer order, for one set of
    input layouts and output shapes: ``specs`` [(name, kind, nbytes)] and per
    buffer ("input", view index, lo) / ("constant", array) / ("output", shape, dtype)."""

    specs: List[Tuple[str, str, int]]
    fills: List[tuple]


def make_plan(sig: Signature, views: Sequence[np.ndarray], outputs) -> Plan:
    index = {p.name: i for i, p in enumerate(p for p in sig.params if p.kind == "input")}
    out_iter = iter(outputs)
    specs, fills = [], []
    for p in sig.params:
        if p.kind == "input":
            v = views[index[p.name]]
            lo, hi = _extent(v)
            specs.append((p.name, "input", hi - lo))
            fills.append(("input", index[p.name], lo))
        elif p.kind in ("shape", "strides", "ndim"):
            v = views[index[p.of]]
            data = {"shape": np.array(v.shape, np.int32),
                    "strides": np.array([s // v.itemsize for s in v.strides], np.int64),
                    "ndim": np.array([v.ndim], np.int32)}[p.kind]
            specs.append((p.name, "constant", data.nbytes))
            fills.append(("constant", data))
        elif p.kind == "output":
            shape, dtype = next(out_iter)
            np_dtype = np.dtype(_NUMPY[dtype])
            specs.append((p.name, "output", int(np.prod(shape)) * np_dtype.itemsize))
            fills.append(("output", shape, np_dtype))
    return Plan(specs, fills)


def _run(compiled: Compiled, plan: Plan, views: Sequence[np.ndarray], dims, placement: Placement,
         fill: int, hole: int, reverse: bool) -> List[np.ndarray]:
    """One run over the whole grid in guarded buffers; its outputs."""
    sig = compiled.signature
    arena = acquire(plan.specs, placement)
    addresses, out_buffers = [], []
    for buf, what in zip(arena.buffers, plan.fills):
        if what[0] == "input":
            addresses.append(_place_input(buf, views[what[1]], what[2], hole))
        elif what[0] == "constant":
            buf.array(what[1].dtype)[:] = what[1]
            addresses.append(buf.address)
        else:
            out_buffers.append((buf, what[1], what[2]))
            addresses.append(buf.address)
    lib, n = compiled.library, len(arena.buffers)
    pointers = (ctypes.c_void_p * max(n, 1))(*addresses)
    fault = _Fault()
    if lib.muser_kv_prepare(arena.table, n, fill) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    faulted = lib.muser_kv_emulate(pointers, dims, int(reverse), ctypes.byref(fault))
    spoiled = lib.muser_kv_finish(arena.table, n)
    if spoiled == -2:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    run = "B" if reverse else "A"
    if faulted:
        inside = arena.inside(fault.address)
        if inside is not None:  # in an input's (read-only) data: a write through an input
            name, offset = inside
            raise MetalFault(f"{sig.name}: write to input `{name}` at byte {offset} "
                             f"(run {run}): a kernel may write its outputs only")
        access = {1: "write", 0: "read"}.get(fault.write, "access")
        raise MetalFault(f"{sig.name}: {access} outside its buffers, at "
                         f"{arena.describe(fault.address)} (run {run})")
    if spoiled >= 0:
        raise MetalFault(f"{sig.name}: wrote outside output `{arena.buffers[spoiled].name}` "
                         f"(run {run}; canary overwritten)")
    return [buf.array(dt).reshape(shape).copy() for buf, shape, dt in out_buffers]


def _place_input(buf, v: np.ndarray, lo: int, hole: int) -> int:
    """Copy an input into its guarded buffer, which covers exactly the bytes its
    view spans, at the same strides; bytes between its elements hold ``hole``.
    Returns the address of its data pointer (MLX's offset included)."""
    if buf.nbytes:
        raw = buf.array()
        if v.flags.c_contiguous and lo == 0 and v.nbytes == buf.nbytes:
            raw[:] = v.reshape(-1).view(np.uint8)
        else:
            ctypes.memset(buf.address, hole, buf.nbytes)
            dst = np.ndarray(v.shape, v.dtype, buffer=raw, offset=-lo, strides=v.strides)
            dst[...] = v
    return buf.address - lo


_DEFAULT: Optional[EmulatedMetal] = None


def default_emulator() -> EmulatedMetal:
    """One emulator (and its caches) per process."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = EmulatedMetal()
    return _DEFAULT
