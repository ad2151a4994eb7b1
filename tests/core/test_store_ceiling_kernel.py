"""The in-place store kernel of benchmarks/store_ceiling.py, checked on the CPU.

It runs on a GPU only in the benchmark (the lead's H200 run), so three
stand-ins check that MLX CUDA and Metal will take it, and that it does what it
says:

* NVRTC: ``build_store_kernel("cuda")`` and ``store_inplace`` driven with
  ``mx.fast.cuda_kernel`` replaced by ``nvrtc``'s recorder; the recorded call
  (the real source text, input/output names, dtypes, template) is turned into
  the source MLX 0.32 generates and compiled for sm_90 with MLX's flags, the
  log empty -- alone and behind MLX's real include set (Shape/Strides as
  ``cuda::std::array``);
* the host harness: g++ compiles the same body under ``MUSER_KV_HOST`` in a
  loop over the grid (writable planes), which must write exactly the K and V
  rows at the slot and copy q;
* the Metal emulator: MLX's own Metal text for the call, through the strict
  check build and the run build; running it must then fault, because the
  emulator maps inputs read-only and this kernel writes through two of them
  (the very thing muser-kv's kernels never do).

Each part skips (saying why) where its toolchain is missing.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import store_ceiling as sc  # noqa: E402

from muser_kv.core.kernels import kernel_header  # noqa: E402

H, D, HEADS, ROWS = 2, 128, 32, 512
ARCH = "sm_90"


def _inputs(dtype=mx.float16, plane=mx.float16, slot=300):
    pk = mx.zeros((1, H, ROWS, D), plane)
    pv = mx.zeros((1, H, ROWS, D), plane)
    k = mx.random.normal((1, H, 1, D)).astype(dtype)
    v = mx.random.normal((1, H, 1, D)).astype(dtype)
    # q as the model hands it: a view with a non-trivial stride (every other head)
    q = mx.random.normal((1, 2 * HEADS, 1, D)).astype(dtype)[:, ::2]
    params = mx.array([slot, ROWS], dtype=mx.int32)
    mx.eval(pk, pv, k, v, q, params)
    return pk, pv, k, v, q, params


def test_grid_and_template():
    pk, pv, k, v, q, params = _inputs()
    assert sc.store_grid(k, q) == (HEADS * D, 1, 1)  # max(2 * 2 * 128, 32 * 128), / 256
    assert sc.store_template(k, pk, q) == [("T", mx.float16), ("P", mx.float16),
                                           ("KV_HEADS", H), ("HEAD_DIM", D), ("HEADS", HEADS)]
    src = sc.store_source()
    assert src.startswith("// muser-kv kernel prelude") and "return " not in sc.STORE_BODY
    # MLX adds a *_strides parameter exactly for the inputs whose strides the body reads
    assert {n for n in sc.STORE_INPUTS if f"{n}_strides" in src} == {"key", "value", "q"}
    assert not any(f"{n}_shape" in src or f"{n}_ndim" in src for n in sc.STORE_INPUTS)


# -- NVRTC ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nvrtc_mod():
    import nvrtc

    try:
        return nvrtc, nvrtc.Nvrtc()
    except nvrtc.NvrtcUnavailable as e:
        if os.environ.get("MUSER_KV_REQUIRE_NVRTC") == "1":
            pytest.fail(f"{e} (MUSER_KV_REQUIRE_NVRTC=1: CI requires these tests)", pytrace=False)
        pytest.skip(str(e))


def _recorded(monkeypatch, dtype, plane):
    import nvrtc

    calls = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", nvrtc.recording_cuda_kernel(calls))
    kernel = sc.build_store_kernel("cuda")
    sc.store_inplace(kernel, *_inputs(dtype, plane))
    assert len(calls) == 1
    return calls[0]


@pytest.mark.parametrize("dtype,plane", [(mx.float16, mx.float16), (mx.float32, mx.float16),
                                         (mx.bfloat16, mx.bfloat16)],
                         ids=["f16-f16", "f32-f16", "bf16-bf16"])
def test_cuda_form_compiles_with_nvrtc(nvrtc_mod, monkeypatch, dtype, plane):
    nvrtc, compiler = nvrtc_mod
    call = _recorded(monkeypatch, dtype, plane)
    assert call.input_names == sc.STORE_INPUTS and call.output_names == sc.STORE_OUTPUTS
    for header in (nvrtc.LIGHT_HEADER, ""):
        source = call.cuda_source(default_header=header)
        if header == "":
            source = nvrtc.FULL_HEADER + source  # MLX's real include set
        assert "const __grid_constant__ Strides q_strides" in source
        assert f"    {nvrtc.CUDA_TYPES[dtype]}* q_out) {{" in source  # the one output
        result = compiler.compile(source, arch=ARCH, name_expressions=[call.name_expression])
        assert result.ok, f"{result.error}\n{result.log}"
        assert result.log.strip() == "", result.log
        lowered = result.lowered[call.name_expression]
        assert f".entry {lowered}(" in result.ptx
        assert result.cubin[:4] == b"\x7fELF"


# -- host harness ----------------------------------------------------------------------


HOST_TYPES = {mx.float16: "_Float16", mx.float32: "float"}


def _host_library(dtype) -> ctypes.CDLL:
    from host_kernels import HOST_HEADER

    gxx = shutil.which("g++")
    if not gxx:
        pytest.skip("no g++")
    t = HOST_TYPES[dtype]
    text = HOST_HEADER + kernel_header() + f"""
extern "C" void host_store_inplace(const void* plane_key_, const void* plane_value_,
    const void* key_, const int64_t* key_strides, const void* value_,
    const int64_t* value_strides, const void* q_, const int64_t* q_strides,
    const int32_t* params, void* q_out_, uint32_t grid) {{
  using T = {t};
  using P = _Float16;
  constexpr int KV_HEADS = {H};
  constexpr int HEAD_DIM = {D};
  constexpr int HEADS = {HEADS};
  const P* plane_key = (const P*)plane_key_;
  const P* plane_value = (const P*)plane_value_;
  const T* key = (const T*)key_;
  const T* value = (const T*)value_;
  const T* q = (const T*)q_;
  T* q_out = (T*)q_out_;
  for (uint32_t muser_kv_tid = 0; muser_kv_tid < grid; ++muser_kv_tid) {{
{sc.store_source()}
  }}
}}
"""
    build = Path(tempfile.gettempdir()) / "muser_kv_host"
    build.mkdir(exist_ok=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    lib = build / f"store_inplace_{digest}.so"
    if not lib.exists():
        src = build / f"store_inplace_{digest}.cpp"
        src.write_text(text)
        tmp = build / f"store_inplace_{digest}.{os.getpid()}.so"
        proc = subprocess.run([gxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-shared", "-fPIC",
                               "-o", str(tmp), str(src)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[:4000]
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32], ids=["f16", "f32"])
def test_host_run_writes_the_rows_in_place(dtype):
    lib = _host_library(dtype)
    slot = 300
    pk, pv, k, v, q, _ = _inputs(dtype, mx.float16, slot)
    planes = [np.random.default_rng(i).standard_normal((1, H, ROWS, D)).astype(np.float16)
              for i in range(2)]
    before = [p.copy() for p in planes]
    kn, vn, qn = (np.array(x) for x in (k, v, q))  # q: numpy view, strided like MLX's
    q_out = np.zeros((1, HEADS, 1, D), kn.dtype)
    params = np.array([slot, ROWS], np.int32)

    def strides(a):
        return np.array([s // a.itemsize for s in a.strides], np.int64)

    ks, vs, qs = strides(kn), strides(vn), strides(qn)
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    lib.host_store_inplace(ptr(planes[0]), ptr(planes[1]), ptr(kn), ptr(ks), ptr(vn), ptr(vs),
                           ptr(qn), ptr(qs), ptr(params), ptr(q_out),
                           ctypes.c_uint32(sc.store_grid(k, q)[0]))
    np.testing.assert_array_equal(q_out, qn)
    for plane, old, new in zip(planes, before, (kn, vn)):
        expect = old.copy()
        expect[:, :, slot:slot + 1] = new.astype(np.float16)
        assert expect.tobytes() == plane.tobytes()


# -- the Metal emulator ------------------------------------------------------------------


def test_metal_text_compiles_and_the_emulator_refuses_the_write():
    import platform

    if not (platform.system() == "Linux" and platform.machine() == "x86_64"):
        pytest.skip("the Metal emulator runs on Linux x86-64")
    from metal_emulator import REQUIRE_ENV, ClangMissing, EmulatedMetal, MetalFault

    try:
        emulator = EmulatedMetal()
    except ClangMissing as e:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{e} ({REQUIRE_ENV} is set: CI must compile the Metal text)",
                        pytrace=False)
        pytest.skip(str(e))
    kernel = emulator(name="muser_kv_store_inplace", input_names=sc.STORE_INPUTS,
                      output_names=sc.STORE_OUTPUTS, source=sc.store_source(),
                      header=kernel_header(), ensure_row_contiguous=False)
    pk, pv, k, v, q, params = _inputs()
    args = dict(inputs=[pk, pv, k, v, q, params], template=sc.store_template(k, pk, q),
                grid=sc.store_grid(k, q), threadgroup=(256, 1, 1),
                output_shapes=[q.shape], output_dtypes=[q.dtype])
    # MLX's generated Metal text, through the strict check build and the run build
    _, text = emulator.text(kernel, args["inputs"], args["output_shapes"], args["output_dtypes"],
                            args["grid"], args["threadgroup"], args["template"])
    assert "  const device float16_t* plane_key [[buffer(0)]]," in text
    assert "  const constant int64_t* q_strides [[buffer(7)]]," in text
    assert "  device float16_t* q_out [[buffer(9)]]," in text
    emulator.compile(text, kernel)
    # inputs are read-only in the emulator: the in-place write is caught
    with pytest.raises(MetalFault):
        kernel(**args)
