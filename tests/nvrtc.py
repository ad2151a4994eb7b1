"""NVRTC on a machine without a GPU: the CUDA compiler MLX uses, from PyPI.

``mx.fast.cuda_kernel`` wraps a kernel body in a generated ``__global__``
function and compiles it with NVRTC when it first runs, so a body that is not
valid CUDA fails only on an NVIDIA machine. NVRTC itself needs no GPU: the
``nvidia-cuda-nvrtc`` wheel (libnvrtc + its builtins), ``nvidia-cuda-runtime``
(cuda_fp16.h, cuda_bf16.h, cooperative_groups.h) and ``nvidia-cuda-cccl``
(cuda/std/...) are plain files, loaded here through ctypes.

``mlx_cuda_source`` rebuilds the source exactly as MLX 0.32's ``build_kernel``
(mlx/backend/cuda/custom_kernel.cpp) does -- parameter list, template values as
``using``/``constexpr`` lines, the body inside ``namespace mlx::core::cu`` --
except that MLX's own device header (``mlx/backend/cuda/device/utils.cuh``,
which the CPU build of MLX does not ship) is replaced by a stand-in that
declares what the generated signature needs: the half types, fixed-width
integers, and ``Shape``/``Strides``.
"""

from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx


class NvrtcUnavailable(RuntimeError):
    """NVRTC or the CUDA headers it needs are not installed."""


# -- finding the wheels ----------------------------------------------------------

# Layout of the CUDA 13 wheels: everything under site-packages/nvidia/cu13.
_LIB = Path("lib") / "libnvrtc.so.13"
_HEADERS = Path("include")  # cuda_fp16.h, cuda_bf16.h, cooperative_groups.h
_CCCL = Path("include") / "cccl"  # cuda/std/...
_NEEDS = {
    _LIB: "libnvrtc (nvidia-cuda-nvrtc)",
    _HEADERS / "cuda_fp16.h": "cuda_fp16.h (nvidia-cuda-runtime)",
    _CCCL / "cuda" / "std" / "array": "cuda/std/array (nvidia-cuda-cccl)",
}


@dataclass(frozen=True)
class Toolkit:
    library: Path
    include_dirs: Tuple[Path, ...]


def find_toolkit() -> Toolkit:
    """The NVRTC library and include directories of the installed CUDA 13 wheels."""
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) / "cu13" for p in (spec.submodule_search_locations or [])] if spec else []
    found: Dict[Path, Path] = {}
    for rel in _NEEDS:
        for root in roots:
            if (root / rel).exists():
                found[rel] = root
                break
    missing = [what for rel, what in _NEEDS.items() if rel not in found]
    if missing:
        raise NvrtcUnavailable(
            "NVRTC toolchain not installed: missing " + ", ".join(missing)
            + "; pip install -e '.[nvrtc]' installs it on Linux x86-64"
        )
    cccl = found[_CCCL / "cuda" / "std" / "array"] / _CCCL
    headers = found[_HEADERS / "cuda_fp16.h"] / _HEADERS
    # MLX passes the CCCL directory first, then $CUDA_HOME/include.
    return Toolkit(library=found[_LIB] / _LIB, include_dirs=(cccl, headers))


# -- calling NVRTC -----------------------------------------------------------------


@dataclass
class CompileResult:
    code: int
    error: str
    log: str
    ptx: str = ""
    cubin: bytes = b""
    lowered: Dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.code == 0


class Nvrtc:
    """A thin ctypes binding of the NVRTC calls MLX's JitModule makes."""

    def __init__(self, toolkit: Optional[Toolkit] = None):
        self.toolkit = toolkit or find_toolkit()
        try:
            lib = ctypes.CDLL(str(self.toolkit.library))
        except OSError as e:
            raise NvrtcUnavailable(f"cannot load {self.toolkit.library}: {e}") from e
        P, S, C = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        sigs = {
            "nvrtcVersion": [ctypes.POINTER(ctypes.c_int)] * 2,
            "nvrtcCreateProgram": [ctypes.POINTER(P), C, C, ctypes.c_int,
                                   ctypes.POINTER(C), ctypes.POINTER(C)],
            "nvrtcDestroyProgram": [ctypes.POINTER(P)],
            "nvrtcAddNameExpression": [P, C],
            "nvrtcCompileProgram": [P, ctypes.c_int, ctypes.POINTER(C)],
            "nvrtcGetProgramLogSize": [P, ctypes.POINTER(S)],
            "nvrtcGetProgramLog": [P, C],
            "nvrtcGetPTXSize": [P, ctypes.POINTER(S)],
            "nvrtcGetPTX": [P, C],
            "nvrtcGetCUBINSize": [P, ctypes.POINTER(S)],
            "nvrtcGetCUBIN": [P, C],
            "nvrtcGetLoweredName": [P, C, ctypes.POINTER(C)],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], C
        self.lib = lib

    @property
    def version(self) -> Tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: {self.lib.nvrtcGetErrorString(code).decode()}")

    def _blob(self, prog, size_fn, get_fn) -> bytes:
        size = ctypes.c_size_t()
        self._check(size_fn(prog, ctypes.byref(size)), size_fn.__name__)
        buf = ctypes.create_string_buffer(size.value)
        self._check(get_fn(prog, buf), get_fn.__name__)
        return buf.raw[:size.value]

    def compile(self, source: str, *, arch: str = "sm_90", name: str = "kernel.cu",
                name_expressions: Sequence[str] = ()) -> CompileResult:
        """Compile ``source`` as MLX does: ``--device-as-default-execution-space
        --gpu-architecture=<arch>`` plus the include paths; on success also the
        PTX, the CUBIN (``sm_*`` only) and each name expression's lowered name."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                                0, None, None), "nvrtcCreateProgram")
        try:
            for expr in name_expressions:
                self._check(self.lib.nvrtcAddNameExpression(prog, expr.encode()),
                            "nvrtcAddNameExpression")
            opts = ["--device-as-default-execution-space", f"--gpu-architecture={arch}"]
            opts += [f"--include-path={d}" for d in self.toolkit.include_dirs]
            argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            code = self.lib.nvrtcCompileProgram(prog, len(opts), argv)
            log = self._blob(prog, self.lib.nvrtcGetProgramLogSize, self.lib.nvrtcGetProgramLog)
            result = CompileResult(code, self.lib.nvrtcGetErrorString(code).decode(),
                                   log.rstrip(b"\0").decode(errors="replace"))
            if not result.ok:
                return result
            result.ptx = self._blob(prog, self.lib.nvrtcGetPTXSize, self.lib.nvrtcGetPTX) \
                .rstrip(b"\0").decode()
            if arch.startswith("sm_"):
                result.cubin = self._blob(prog, self.lib.nvrtcGetCUBINSize, self.lib.nvrtcGetCUBIN)
            for expr in name_expressions:
                lowered = ctypes.c_char_p()
                self._check(self.lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(lowered)),
                            "nvrtcGetLoweredName")
                result.lowered[expr] = lowered.value.decode()
            return result
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


# -- the source MLX generates -----------------------------------------------------

# dtype_to_cuda_type (mlx/backend/cuda/utils.cpp) and get_type_string
# (mlx/backend/common/compiled.cpp, used for the kernel-name hash).
CUDA_TYPES = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
    mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
    mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}
TYPE_STRINGS = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
    mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
    mx.int64: "int64_t", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
}

# MLX 0.32.4's default header (the string in libmlx.so of mlx-cuda-13) is
# `#include "mlx/backend/cuda/device/utils.cuh"` then `#include
# <cooperative_groups.h>`. utils.cuh includes cuda_bf16.h, cuda_fp16.h and
# cuda/std/{array,limits,tuple} and declares Shape/Strides (MAX_NDIM = 10) in
# mlx::core::cu. FULL_HEADER is that, minus MLX's own helpers; LIGHT_HEADER
# declares the same names with cheap headers (NVRTC parses cuda/std/array and
# cooperative_groups.h in seconds, these in tens of milliseconds) so that each
# instantiation can be compiled on its own.
FULL_HEADER = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
} // namespace mlx::core::cu

#include <cooperative_groups.h>

"""

LIGHT_HEADER = r"""
#include <cuda/std/cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
namespace cooperative_groups {}
namespace mlx::core::cu {
template <typename V>
struct StandInArray {
  V v[10];
  __host__ __device__ V& operator[](int i) { return v[i]; }
  __host__ __device__ const V& operator[](int i) const { return v[i]; }
};
using Shape = StandInArray<int32_t>;
using Strides = StandInArray<int64_t>;
} // namespace mlx::core::cu

"""

TemplateArg = Tuple[str, object]


def template_hash(template: Sequence[TemplateArg]) -> str:
    out = ""
    for _, value in template:
        if isinstance(value, bool):
            out += "_t" if value else "_f"
        elif isinstance(value, int):
            out += f"_{value}"
        else:
            out += "_" + TYPE_STRINGS[value]
    return out


def mlx_cuda_source(func_name: str, source: str, input_names: Sequence[str],
                    inputs: Sequence[mx.array], output_names: Sequence[str],
                    output_dtypes: Sequence, template: Sequence[TemplateArg] = (),
                    header: str = "", default_header: str = LIGHT_HEADER) -> str:
    """The kernel source ``build_kernel`` generates (MLX 0.32), with
    ``default_header`` standing in for MLX's."""
    text = default_header + header
    text += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void {func_name}(\n"
    for name, arr in zip(input_names, inputs):
        text += f"    const {CUDA_TYPES[arr.dtype]}* {name},\n"
        if arr.ndim > 0:  # the same substring test as MLX's factory
            if f"{name}_shape" in source:
                text += f"    const __grid_constant__ Shape {name}_shape,\n"
            if f"{name}_strides" in source:
                text += f"    const __grid_constant__ Strides {name}_strides,\n"
            if f"{name}_ndim" in source:
                text += f"    const __grid_constant__ int {name}_ndim,\n"
    for i, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        text += f"    {CUDA_TYPES[dtype]}* {name}"
        text += ",\n" if i < len(output_names) - 1 else ") {\n"
    if template:
        for name, value in template:
            if isinstance(value, bool):
                text += f"  constexpr bool {name} = {str(value).lower()};\n"
            elif isinstance(value, int):
                text += f"  constexpr int {name} = {value};\n"
            else:
                text += f"  using {name} = {CUDA_TYPES[value]};\n"
        text += "\n"
    text += source
    text += "\n}\n\n} // namespace mlx::core::cu\n"
    return text


@dataclass
class KernelCall:
    """One call of a ``mx.fast.cuda_kernel`` kernel: what MLX would compile."""

    name: str
    input_names: List[str]
    output_names: List[str]
    source: str
    header: str
    inputs: List[mx.array]
    output_dtypes: List
    template: List[TemplateArg]

    @property
    def func_name(self) -> str:
        return "custom_kernel_" + self.name + template_hash(self.template)

    @property
    def name_expression(self) -> str:
        return "mlx::core::cu::" + self.func_name  # what MLX looks the kernel up by

    def cuda_source(self, default_header: str = LIGHT_HEADER, source: Optional[str] = None) -> str:
        return mlx_cuda_source(self.func_name, self.source if source is None else source,
                               self.input_names, self.inputs, self.output_names,
                               self.output_dtypes, self.template, self.header, default_header)


def recording_cuda_kernel(calls: List[KernelCall]):
    """A stand-in for ``mx.fast.cuda_kernel`` (same arguments) whose kernels
    record each call in ``calls`` and return zero outputs instead of running."""

    def factory(name, input_names, output_names, source, header="",
                ensure_row_contiguous=True, shared_memory=0):
        def kernel(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                   init_value=None, verbose=False, stream=None):
            calls.append(KernelCall(name, list(input_names), list(output_names), source, header,
                                    list(inputs), list(output_dtypes), list(template or [])))
            return [mx.zeros(tuple(s), d) for s, d in zip(output_shapes, output_dtypes)]
        return kernel

    return factory
