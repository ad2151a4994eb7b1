"""Run the real kernel bodies on the CPU: g++ compiles each body's source text
(the same text MLX hands to Metal and NVRTC) behind the host prelude, inside a
loop that walks the grid one thread at a time; ctypes calls it on numpy data.

_Float16 is IEEE binary16 with round-to-nearest-even conversions, which is what
Metal's `half` and CUDA's `__float2half_rn` do; bf16 has no host type, so the
header gives it MLX's own CPU conversion (round to nearest even, NaN -> 0x7FC0);
MLX's CPU half writes every NaN as sign | 0x7D00, and the header does the same.
Either way the host run must agree with the MLX reference bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from muser_kv.core.kernels import THREADGROUP, kernel_header, kernel_source

# bf16 has no host type: a 16-bit pattern whose float value is the top half of an
# f32, converted from f32 exactly as MLX's CPU backend does (mlx/types/bf16.h).
HOST_HEADER = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#define MUSER_KV_HOST 1
struct bf16_t {
  uint16_t bits;
  explicit operator float() const {
    uint32_t u = (uint32_t)bits << 16; float f; std::memcpy(&f, &u, 4); return f;
  }
};
template <typename P> P muser_kv_host_plane(float x);
template <> inline _Float16 muser_kv_host_plane<_Float16>(float x) {
  if (std::isnan(x)) {  // MLX's CPU half keeps the sign and sets mantissa 0x100
    uint32_t u; std::memcpy(&u, &x, 4);
    uint16_t bits = (uint16_t)(((u >> 16) & 0x8000u) | 0x7D00u);
    _Float16 h; std::memcpy(&h, &bits, 2); return h;
  }
  return (_Float16)x;
}
template <> inline bf16_t muser_kv_host_plane<bf16_t>(float x) {
  bf16_t out;
  if (std::isnan(x)) { out.bits = 0x7FC0; return out; }
  uint32_t u; std::memcpy(&u, &x, 4);
  u += (u >> 16 & 1) + 0x7FFFu;
  out.bits = (uint16_t)(u >> 16);
  return out;
}
"""

def geometry_params(kv_heads: int, head_dim: int, head_major: bool) -> List[int]:
    """The last three ``params`` of every kernel (``kernels._geometry``)."""
    return [kv_heads, head_dim, int(head_major)]


TYPES = {"float32": "float", "float16": "_Float16", "bfloat16": "bf16_t"}
PLANE_TYPES = ("float16", "bfloat16")

# name -> list of (c type, parameter name); "T*" is the templated input type,
# "strides:x" an int64 stride array for input x, "H*" a plane of type P.
SIGNATURES: Dict[str, List[Tuple[str, str]]] = {
    "batch_store": [("T*", "key"), ("strides", "key"), ("T*", "value"), ("strides", "value"),
                    ("int32*", "params"), ("H*out", "key_rows"), ("H*out", "value_rows"),
                    ("int32*out", "dest")],
    "stage": [("H*", "ring_key"), ("H*", "ring_value"), ("T*", "key"), ("strides", "key"),
              ("T*", "value"), ("strides", "value"), ("int32*", "params"),
              ("H*out", "shadow_key"), ("H*out", "shadow_value")],
    "gather": [("H*", "plane_key"), ("H*", "plane_value"), ("int32*", "params"),
               ("H*out", "out_key"), ("H*out", "out_value")],
    "install": [("H*", "rows_key"), ("H*", "rows_value"), ("int32*", "params"),
                ("H*out", "plane_key"), ("H*out", "plane_value")],
}


def _function(name: str, dtype: str, plane: str) -> Tuple[str, str]:
    fn = f"host_{name}_{dtype}_{plane}"
    params, casts = [], []
    for kind, pname in SIGNATURES[name]:
        if kind == "strides":
            params.append(f"const int64_t* {pname}_strides")
        elif kind == "T*":
            params.append(f"const void* {pname}_")
            casts.append(f"const T* {pname} = (const T*){pname}_;")
        elif kind == "H*":
            params.append(f"const void* {pname}_")
            casts.append(f"const P* {pname} = (const P*){pname}_;")
        elif kind == "H*out":
            params.append(f"void* {pname}_")
            casts.append(f"P* {pname} = (P*){pname}_;")
        elif kind == "int32*":
            params.append(f"const int32_t* {pname}")
        elif kind == "int32*out":
            params.append(f"int32_t* {pname}")
    params.append("uint32_t grid")
    body = kernel_source(name)
    text = f"""
extern "C" void {fn}({", ".join(params)}) {{
  using T = {TYPES[dtype]};
  using P = {TYPES[plane]};
  {" ".join(casts)}
  for (uint32_t muser_kv_tid = 0; muser_kv_tid < grid; ++muser_kv_tid) {{
{body}
  }}
}}
"""
    return fn, text


def build_library(source: str, flags: Sequence[str] = ("-std=c++17", "-O2")) -> ctypes.CDLL:
    """``source`` compiled by g++ with ``flags`` into a shared library, kept in the
    temp dir under the digest of both (built under a name of its own, then moved
    into place: test workers build at once)."""
    digest = hashlib.sha256("\0".join([source, *flags]).encode()).hexdigest()[:16]
    build = Path(tempfile.gettempdir()) / "muser_kv_host"
    build.mkdir(exist_ok=True)
    lib = build / f"kernels_{digest}.so"
    if not lib.exists():
        src = build / f"kernels_{digest}.cpp"
        src.write_text(source)
        tmp = build / f"kernels_{digest}.{os.getpid()}.so"
        subprocess.run([shutil.which("g++") or "g++", *flags, "-shared", "-fPIC", "-o", str(tmp),
                        str(src)], check=True, capture_output=True, text=True)
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


class HostKernels:
    """Compiles every (kernel, input type, plane type) instantiation once, into one
    library: 16 functions (gather and install read planes only: input type = plane
    type). As on the GPUs, the element types are the only compile-time values;
    head geometry and layout arrive in ``params`` (``geometry_params``)."""

    def __init__(self):
        funcs, texts = {}, [HOST_HEADER, kernel_header()]
        for name in SIGNATURES:
            for plane in PLANE_TYPES:
                inputs = TYPES if name in ("batch_store", "stage") else (plane,)
                for dtype in inputs:
                    fn, text = _function(name, dtype, plane)
                    funcs[(name, dtype, plane)] = fn
                    texts.append(text)
        self.lib = build_library("\n".join(texts))
        self.funcs = funcs

    def call(self, name: str, dtype: str, args: Sequence, threads: int,
             plane: str = "float16") -> None:
        """Run kernel ``name`` for input type ``dtype`` and plane type ``plane`` over
        the grid a GPU launches for ``threads``; ``args`` in signature order, its
        ``params`` ending in ``geometry_params``."""
        grid = max(1, -(-threads // THREADGROUP)) * THREADGROUP  # as the GPUs launch it
        ptrs = []
        for a in args:
            a = np.asarray(a)
            ptrs.append(ctypes.c_void_p(a.ctypes.data))
        fn = self.funcs[(name, dtype, plane)]
        getattr(self.lib, fn)(*ptrs, ctypes.c_uint32(grid))
