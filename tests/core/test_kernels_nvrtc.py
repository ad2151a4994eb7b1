"""CI compiles the CUDA variant of every kernel body with NVRTC, no GPU needed.

The cuda backend is driven with ``mx.fast.cuda_kernel`` replaced by a recorder,
so what gets compiled is exactly what ``KernelBackend("cuda")`` hands MLX: the
real source text (``kernel_source(name)``: prelude + body), its input and
output names, the input dtypes, and the template values. Each call is turned
into the source MLX 0.32 generates around a body (see ``nvrtc.mlx_cuda_source``)
and compiled for sm_90 (H200) with MLX's NVRTC flags; the log must be empty
(no error, no warning) and the PTX and CUBIN must hold the kernel MLX looks up.

The NVRTC wheels are the ``nvrtc`` extra (Linux x86-64 only). CI installs it
and sets ``MUSER_KV_REQUIRE_NVRTC=1``: there these tests must run, and a missing
wheel fails them. Anywhere else without the wheels they skip, saying how to
install them.
"""

import os
import platform
import re

import mlx.core as mx
import pytest
from nvrtc import FULL_HEADER, KernelCall, Nvrtc, NvrtcUnavailable, recording_cuda_kernel

from muser_kv import Ring
from muser_kv.core.kernels import HEAD_MAJOR, INPUT_DTYPES, PLANE_DTYPES, TOKEN_MAJOR, KernelBackend

ARCH = "sm_90"  # H200
H, D = 2, 128
# head geometries the backend is driven with: Muse Glimmer's and a tiny one; the
# programs must not differ between them (geometry is a runtime value, in params)
GEOMETRIES = ((H, D), (1, 4))
CAPACITY, CHUNK = 8, 4
CI_PLATFORM = platform.system() == "Linux" and platform.machine() == "x86_64"
DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}

# (kernel, T, P) -- every instantiation the backend can ask for: the element
# types are its only template values (head geometry and layout are params), so
# 16 programs (gather and install read planes only, so their T is the plane type P).
_INPUTS = ("float32", "float16", "bfloat16")
_PLANES = ("float16", "bfloat16")
EXPECTED = (
    [(k, t, p) for k in ("batch_store", "stage") for t in _INPUTS for p in _PLANES]
    + [(k, p, p) for k in ("gather", "install") for p in _PLANES]
)


def case_id(case):
    return "-".join(case)


REQUIRED = os.environ.get("MUSER_KV_REQUIRE_NVRTC") == "1"  # set by .ci/run

# The nvrtc extra installs NVRTC only on Linux x86-64 (CI's platform).
pytestmark = pytest.mark.skipif(not CI_PLATFORM and not REQUIRED,
                                reason="the nvrtc extra installs NVRTC on Linux x86-64 only")


@pytest.fixture(scope="module")
def nvrtc():
    try:
        return Nvrtc()
    except NvrtcUnavailable as e:
        if REQUIRED:
            pytest.fail(f"{e} (MUSER_KV_REQUIRE_NVRTC=1: CI requires these tests)", pytrace=False)
        pytest.skip(f"{e} (optional outside CI; .ci/run installs it and requires these tests)")


def _key(call: KernelCall):
    template = dict(call.template)
    plane = DTYPE_NAMES[template["P"]]
    return (call.name.removeprefix("muser_kv_"), DTYPE_NAMES[template.get("T", template["P"])],
            plane)


def _geometry(call: KernelCall):
    """(kv_heads, head_dim, head_major): the call's last three params."""
    params = call.inputs[call.input_names.index("params")]
    return tuple(int(x) for x in params.tolist()[-3:])


@pytest.fixture(scope="module")
def recorded():
    """Every kernel call the cuda backend makes, for both geometries and layouts."""
    out = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "cuda_kernel", recording_cuda_kernel(out))
        backend = KernelBackend("cuda")
        live = Ring(CAPACITY, 5, 9, 1)  # wrapped: origin_logical 9 at physical row 1
        for h, d in GEOMETRIES:
            shapes = ((TOKEN_MAJOR, (CAPACITY, h * d)), (HEAD_MAJOR, (h, CAPACITY, d)))
            for plane_dtype in PLANE_DTYPES:
                for dtype in INPUT_DTYPES:
                    kv = mx.zeros((1, h, CHUNK, d), dtype)
                    for layout in (TOKEN_MAJOR, HEAD_MAJOR):
                        backend.store_with_dest(kv, kv, layout, 0, CHUNK, Ring(CAPACITY), 0,
                                                plane_dtype)
                    for layout, shape in shapes:
                        ring_plane = mx.zeros(shape, plane_dtype)
                        backend.stage(ring_plane, ring_plane, live, kv, kv, layout)
                for layout, shape in shapes:
                    plane = mx.zeros(shape, plane_dtype)
                    backend.gather(plane, plane, layout, live)
                    rows = mx.zeros((live.len, h * d), plane_dtype)
                    backend.install(rows, rows, layout, live, shape)
    return out


@pytest.fixture(scope="module")
def calls(recorded):
    """The first call of each instantiation, keyed like ``EXPECTED``."""
    out = {}
    for call in recorded:
        out.setdefault(_key(call), call)
    return out


def _check_compiled(result, call: KernelCall) -> None:
    assert result.ok, f"{call.func_name}: {result.error}\n{result.log}"
    assert result.log.strip() == "", f"{call.func_name}: NVRTC log is not clean:\n{result.log}"
    lowered = result.lowered[call.name_expression]
    assert lowered.startswith("_ZN3mlx4core2cu") and call.func_name in lowered, lowered
    assert f".target {ARCH}" in result.ptx
    assert f".entry {lowered}(" in result.ptx, f"no entry {lowered} in the PTX"
    assert result.cubin[:4] == b"\x7fELF" and lowered.encode() in result.cubin


def test_backend_asks_for_every_instantiation(calls):
    assert set(EXPECTED) <= set(calls), sorted(set(EXPECTED) - set(calls), key=str)


def test_one_program_per_kernel_and_type_pair(recorded):
    """Both geometries and both layouts, every kernel: 16 programs, as many as
    (kernel, T, P) pairs; each program served every geometry and layout through
    its params. Head geometry or layout back among the template values would
    make more (MLX compiles one program per function name and template)."""
    programs = {(call.func_name, call.cuda_source()) for call in recorded}
    assert len(programs) == len(EXPECTED) == 16, sorted(name for name, _ in programs)
    assert all(dict(call.template).keys() <= {"T", "P"} for call in recorded)
    served = {}
    for call in recorded:
        served.setdefault(_key(call), set()).add(_geometry(call))
    for key, geometries in served.items():
        layouts = {hm for _, _, hm in geometries}
        assert layouts == {0, 1}, (key, geometries)
        if key[0] in ("batch_store", "stage"):  # gather/install see token-major as one head
            assert {(h, d) for h, d, _ in geometries} == set(GEOMETRIES), (key, geometries)


@pytest.mark.parametrize("case", EXPECTED, ids=case_id)
def test_kernel_compiles_with_nvrtc(nvrtc, calls, case):
    call = calls.get(case)
    assert call is not None, f"the cuda backend made no {case} call (made: {sorted(calls, key=str)})"
    # What the brief of this test promises: the real text, MLX's signature.
    assert call.source.startswith("// muser-kv kernel prelude")
    source = call.cuda_source()
    assert "namespace mlx::core::cu {" in source and "  using P = " in source
    result = nvrtc.compile(source, arch=ARCH, name_expressions=[call.name_expression])
    _check_compiled(result, call)
    if case[0] in ("batch_store", "stage"):
        # TO_PLANE is MLX's astype: one round to nearest even from the input
        # type, or, when the input is of the plane type already, a copy.
        _, t, p = case
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
        conversions = set(re.findall(r"cvt\.rn\.(?:f16|bf16)\.\w+", result.ptx))
        expect = set() if t == p else {f"cvt.rn.{short[p]}.{short[t]}"}
        assert conversions == expect, (conversions, expect)


def test_all_kernels_compile_with_mlx_default_includes(nvrtc, calls):
    """Every call again, in one program, behind MLX's real include set
    (cuda::std::array Shape/Strides, cooperative_groups)."""
    assert calls
    source = FULL_HEADER + "\n".join(
        call.cuda_source(default_header="") for call in calls.values())
    result = nvrtc.compile(source, arch=ARCH,
                           name_expressions=[c.name_expression for c in calls.values()])
    for call in calls.values():
        _check_compiled(result, call)


def test_generated_signature(calls):
    """The parameter list MLX 0.32 generates (custom_kernel.cpp, build_kernel)."""
    source = calls[("batch_store", "bfloat16", "float16")].cuda_source(default_header="")
    assert (
        "__global__ void custom_kernel_muser_kv_batch_store_bfloat16_t_float16_t(\n"
        "    const __nv_bfloat16* key,\n"
        "    const __grid_constant__ Strides key_strides,\n"
        "    const __nv_bfloat16* value,\n"
        "    const __grid_constant__ Strides value_strides,\n"
        "    const int32_t* params,\n"
        "    __half* key_rows,\n"
        "    __half* value_rows,\n"
        "    int32_t* dest) {\n"
        "  using T = __nv_bfloat16;\n"
        "  using P = __half;\n"
        "\n"
        "// muser-kv kernel prelude"
    ) in source


@pytest.mark.parametrize("bad, expect", [
    ("muser_kv_undeclared += 1;", 'identifier "muser_kv_undeclared" is undefined'),
    # params is `const int32_t*` in the generated signature, never a scalar
    ("if (KIDX_GLOBAL_X < params) { dest[0] = 0; }", "operand types are incompatible"),
], ids=["undeclared", "scalar-params"])
def test_broken_body_fails(nvrtc, calls, bad, expect):
    """Negative control: the same pipeline rejects a body that is not valid CUDA."""
    call = calls[("batch_store", "float32", "float16")]
    result = nvrtc.compile(call.cuda_source(source=call.source + "\n" + bad + "\n"), arch=ARCH,
                           name_expressions=[call.name_expression])
    assert not result.ok
    assert expect in result.log, result.log
