"""Decode attention's tensor-core kernel (kernels/attend_mma.{cu,h}: the chunks'
partials, folded and combined by the same blocks, in one launch) compiles with
NVRTC for sm_90a, exactly as MLX 0.32 wraps it, no GPU needed.

``attention_cuda.attend_mma`` is driven with ``mx.fast.cuda_kernel``
replaced by a recorder, so what gets compiled is what the launcher hands MLX:
the body, the header, the input and output names, the dtypes and the template
values (T, P, HD, SPAN). Each (T, P, HD) is compiled for sm_90a (H100/H200, what MLX
targets there) with MLX's flags: the log must be clean, the PTX and CUBIN must
hold the kernel MLX looks up, and the PTX must use the tensor-core path
(mma.sync m16n8k16 with f32 accumulation, ldmatrix, cp.async) and no float
atomics (the fold's counters are integers). A second
compile with ``--ptxas-options=-v`` checks registers and spills: the occupancy
the launcher's shared memory is sized for (3 blocks of 128 threads per SM at
D = 128) needs at most 168 registers, and no spills at D <= 128. Each span a
block may take (``attention_cuda.SPANS``) compiles too, with its own shared
memory and grid.

Skips like the other NVRTC tests when the wheels are missing (required in CI
with ``MUSER_KV_REQUIRE_NVRTC=1``).
"""

import ctypes
import os
import platform
import re

import mlx.core as mx
import pytest
from nvrtc import FULL_HEADER, KernelCall, Nvrtc, NvrtcUnavailable, recording_cuda_kernel

from muser_kv.core import attention_cuda
from muser_kv.core.attention import KeyRead

ARCH = "sm_90a"
CI_PLATFORM = platform.system() == "Linux" and platform.machine() == "x86_64"
REQUIRED = os.environ.get("MUSER_KV_REQUIRE_NVRTC") == "1"
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
PLANES = ("bfloat16", "float16")
PTX_TYPE = {"bfloat16": "bf16", "float16": "f16"}
# (queries T, K/V P, head_dim): every instantiation the launcher can ask for
CASES = [(t, p, d) for t in DTYPES for p in PLANES for d in attention_cuda.HEAD_DIMS]

pytestmark = pytest.mark.skipif(not CI_PLATFORM and not REQUIRED,
                                reason="the nvrtc extra installs NVRTC on Linux x86-64 only")


def case_id(case):
    return f"{case[0]}-{case[1]}-d{case[2]}"


@pytest.fixture(scope="module")
def nvrtc():
    try:
        return Nvrtc()
    except NvrtcUnavailable as e:
        if REQUIRED:
            pytest.fail(f"{e} (MUSER_KV_REQUIRE_NVRTC=1: CI requires these tests)", pytrace=False)
        pytest.skip(f"{e} (optional outside CI; .ci/run installs it and requires these tests)")


class Recorder:
    """``mx.fast.cuda_kernel`` stand-in that also keeps the factory's shared
    memory and each launch's grid and threadgroup."""

    def __init__(self):
        self.calls = []
        self.launches = []
        self._inner = recording_cuda_kernel(self.calls)

    def __call__(self, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, shared_memory=0):
        kernel = self._inner(name, input_names, output_names, source, header,
                             ensure_row_contiguous, shared_memory)

        def launch(**kwargs):
            self.launches.append(dict(name=name, shared_memory=shared_memory,
                                      ensure_row_contiguous=ensure_row_contiguous,
                                      grid=kwargs["grid"], threadgroup=kwargs["threadgroup"],
                                      output_shapes=kwargs["output_shapes"]))
            return kernel(**kwargs)
        return launch


@pytest.fixture(scope="module")
def recorded():
    rec = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "cuda_kernel", rec)
        mp.setattr(attention_cuda, "_built", {})
        for t, p, d in CASES:
            # Muse Glimmer's group (16 query heads per K/V head), 4 tokens, strided K/V
            q = mx.zeros((2, 32, 4, d), DTYPES[t])
            plane = mx.zeros((3, 10, 2, d), DTYPES[p])  # token-major: [S, R, H, D]
            kv = plane.transpose(0, 2, 1, 3)
            seqs = [KeyRead(0, 700, 600, 3, 10), KeyRead(2, 9, 9, 0, 10)]
            params = attention_cuda.kernel_params(2, 2, 16, 4, d, 256, 3, 0, seqs, sinks=1)
            attention_cuda.attend_mma(q, kv, kv, params, 0.125, 3, 64,
                                      sinks=mx.zeros((32,), mx.float32))
        for span in SPANS[1:]:
            q = mx.zeros((2, 32, 1, 128), mx.bfloat16)
            kv = mx.zeros((3, 2, 8000, 128), mx.bfloat16)  # head-major planes
            seqs = [KeyRead(0, 7000, 7000, 0, 8000), KeyRead(2, 300, 300, 0, 8000)]
            params = attention_cuda.kernel_params(2, 2, 16, 1, 128, 256, 28, 0, seqs)
            attention_cuda.attend_mma(q, kv, kv, params, 0.125, 28, 16, span=span)
    return rec


SPANS = attention_cuda.SPANS


@pytest.fixture(scope="module")
def calls(recorded):
    names = {v: k for k, v in DTYPES.items()}
    return {(names[dict(c.template)["T"]], names[dict(c.template)["P"]], dict(c.template)["HD"]): c
            for c in recorded.calls if dict(c.template)["SPAN"] == 1}


@pytest.fixture(scope="module")
def span_calls(recorded):
    """span -> the (bf16, bf16, 128) launch that takes it."""
    return {dict(c.template)["SPAN"]: c for c in recorded.calls if dict(c.template)["SPAN"] > 1}


def _check_compiled(result, call: KernelCall) -> None:
    assert result.ok, f"{call.func_name}: {result.error}\n{result.log}"
    assert result.log.strip() == "", f"{call.func_name}: NVRTC log is not clean:\n{result.log}"
    lowered = result.lowered[call.name_expression]
    assert lowered.startswith("_ZN3mlx4core2cu") and call.func_name in lowered, lowered
    assert f".target {ARCH}" in result.ptx
    assert f".entry {lowered}(" in result.ptx, f"no entry {lowered} in the PTX"
    assert result.cubin[:4] == b"\x7fELF" and lowered.encode() in result.cubin


def test_launcher_geometry(recorded):
    """One block of 128 threads per (sequence, K/V head, chunk, 16-row M tile),
    the header's shared memory, strided inputs passed as they are."""
    assert len(recorded.launches) == len(CASES) + len(SPANS) - 1
    for launch, (_, _, d) in zip(recorded.launches, CASES):
        blocks = 2 * 2 * 3 * 4  # B, Hkv, max_chunks, ceil(64 / 16)
        assert launch["grid"] == (128 * blocks, 1, 1)
        assert launch["threadgroup"] == (128, 1, 1)
        assert launch["shared_memory"] == attention_cuda.shared_bytes(d)
        assert launch["ensure_row_contiguous"] is False
        out, partials, merged = (list(shape) for shape in launch["output_shapes"])
        assert out == [2, 32, 4, d] and partials == [2, 2, 3, 64, d + 2]
        assert merged == [2, 2, 1, 64, d + 2]  # ceil(3 / FOLD) folds
        assert launch["name"] == attention_cuda.kernel_name(d)
    assert attention_cuda.shared_bytes(128) == 74_496  # 3 blocks per SM on H100/H200
    assert attention_cuda.shared_bytes(256) <= 227 * 1024
    for launch, span in zip(recorded.launches[len(CASES):], SPANS[1:]):
        blocks = 2 * 2 * -(-28 // span)  # B, Hkv, spans of 28 chunks, one M tile
        assert launch["grid"] == (128 * blocks, 1, 1)
        assert launch["shared_memory"] == attention_cuda.shared_bytes(128, span)
        assert launch["name"] == attention_cuda.kernel_name(128, span)
        assert launch["output_shapes"][1] == (2, 2, 28, 16, 130)  # a partial per chunk
    assert 2 * attention_cuda.shared_bytes(128, 2) <= 227 * 1024  # 2 blocks per SM


def test_span_is_chosen_by_the_grid(monkeypatch):
    """``span_for``: one chunk a block unless ``FULL_GRID`` is set; then
    ``LONG_SPAN`` chunks for long sequences whose grid still has that many blocks."""
    assert attention_cuda.span_for(8, 2, 512, 16) == 1    # off by default
    monkeypatch.setattr(attention_cuda, "FULL_GRID", 512)
    assert attention_cuda.span_for(8, 2, 512, 16) == 16   # 512 blocks of 16 chunks
    assert attention_cuda.span_for(1, 2, 512, 16) == 1    # 64: too few
    assert attention_cuda.span_for(64, 2, 5, 16) == 1     # a sliding layer's few chunks
    with pytest.raises(ValueError, match="span 3"):
        attention_cuda.attend_mma(mx.zeros((1, 32, 1, 128), mx.bfloat16),
                                  mx.zeros((1, 2, 512, 128), mx.bfloat16),
                                  mx.zeros((1, 2, 512, 128), mx.bfloat16),
                                  [1, 2, 16, 1, 128, 256, 2, 0, 0, 512, 512, 0, 512],
                                  0.1, 2, 16, span=3)


@pytest.mark.parametrize("span", SPANS[1:])
def test_each_span_compiles_without_spills(nvrtc, span_calls, span):
    call = span_calls[span]
    result = nvrtc.compile(call.cuda_source(), arch=ARCH, name_expressions=[call.name_expression])
    _check_compiled(result, call)
    log = _ptxas_verbose(nvrtc, call.cuda_source())
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills.group(1) == "0" and spills.group(2) == "0", log
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    assert regs <= 255, log  # 2 blocks x 128 threads per SM


def test_signature_and_template(calls):
    call = calls[("bfloat16", "bfloat16", 128)]
    source = call.cuda_source(default_header="")
    assert (
        "__global__ void custom_kernel_muser_kv_attend_mma_d128_bfloat16_t_bfloat16_t_128_1(\n"
        "    const __nv_bfloat16* queries,\n"
        "    const __grid_constant__ Strides queries_strides,\n"
        "    const __nv_bfloat16* keys,\n"
        "    const __grid_constant__ Strides keys_strides,\n"
        "    const __nv_bfloat16* values,\n"
        "    const __grid_constant__ Strides values_strides,\n"
        "    const float* scale,\n"
        "    const float* sinks,\n"
        "    const int32_t* params,\n"
        "    const __grid_constant__ Shape params_shape,\n"
        "    const int32_t* counters,\n"
        "    __nv_bfloat16* out,\n"
        "    float* partials,\n"
        "    float* merged) {\n"
        "  using T = __nv_bfloat16;\n"
        "  using P = __nv_bfloat16;\n"
        "  constexpr int HD = 128;\n"
        "  constexpr int SPAN = 1;\n"
    ) in source


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_compiles_for_sm90a(nvrtc, calls, case):
    call = calls[case]
    result = nvrtc.compile(call.cuda_source(), arch=ARCH, name_expressions=[call.name_expression])
    _check_compiled(result, call)
    ptx = result.ptx
    t = PTX_TYPE[case[1]]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
    # the fold's counters are the only atomics: integer adds, never a float one
    atomics = re.findall(r"^\s*(?:@%p\d+\s+)?((?:atom|red)\.\S+)", ptx, re.M)
    assert atomics and all(a.endswith((".u32", ".s32")) and ".add" in a for a in atomics), atomics


def test_compiles_with_mlx_default_includes(nvrtc, calls):
    """Every instantiation in one program, behind MLX's real include set."""
    source = FULL_HEADER + "\n".join(
        # the header is file scope and guarded by nothing: include it once
        c.cuda_source(default_header="").replace(c.header, "", 1) if i else
        c.cuda_source(default_header="")
        for i, c in enumerate(calls.values()))
    result = nvrtc.compile(source, arch=ARCH,
                           name_expressions=[c.name_expression for c in calls.values()])
    for call in calls.values():
        _check_compiled(result, call)


def _ptxas_verbose(nvrtc, source: str) -> str:
    """Compile as MLX does, plus ``--ptxas-options=-v``; the log."""
    lib = nvrtc.lib
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"attend_mma.cu",
                                  0, None, None) == 0
    try:
        opts = ["--device-as-default-execution-space", f"--gpu-architecture={ARCH}",
                "--ptxas-options=-v"]
        opts += [f"--include-path={d}" for d in nvrtc.toolkit.include_dirs]
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        code = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        assert code == 0, log
        return log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == c[1] == "bfloat16" or c[2] == 128],
                         ids=case_id)
def test_registers_and_spills(nvrtc, calls, case):
    log = _ptxas_verbose(nvrtc, calls[case].cuda_source())
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    d = case[2]
    print(f"{case}: {regs} registers, {spills.group(0)}")
    if d <= 128:
        assert regs <= 168, log  # 3 blocks x 128 threads per SM
        assert spills.group(1) == "0" and spills.group(2) == "0", log


def test_shared_bytes_match_header(nvrtc, calls):
    """The launcher's shared memory is the header's smem_bytes(HD)."""
    header = calls[("bfloat16", "bfloat16", 128)].header
    checks = "".join(
        f"static_assert(muser_attend::smem_bytes({d}, {s}) == {attention_cuda.shared_bytes(d, s)}, "
        f"\"smem {d} {s}\");\n" for d in attention_cuda.HEAD_DIMS for s in (1, 2, 16))
    checks += f"static_assert(muser_attend::THREADS == {attention_cuda.THREADS}, \"threads\");\n"
    checks += f"static_assert(muser_attend::ROWS == {attention_cuda.ROWS}, \"rows\");\n"
    checks += f"static_assert(muser_attend::STAGES == {attention_cuda.STAGES}, \"stages\");\n"
    checks += f"static_assert(muser_attend::WARPS == {attention_cuda.WARPS}, \"warps\");\n"
    checks += f"static_assert(muser_attend::TK == {attention_cuda.TILE_KEYS}, \"tile keys\");\n"
    checks += f"static_assert(muser_attend::FOLD == {attention_cuda.FOLD}, \"fold\");\n"
    for d in attention_cuda.HEAD_DIMS:  # the combine's shared memory holds most_chunks, no more
        groups = attention_cuda.most_chunks(d) // attention_cuda.FOLD
        room = f"muser_attend::ring_floats({d}) - muser_attend::TAIL_FIXED - 2 * muser_attend::ROWS * {{}}"
        checks += f"static_assert({room.format(groups)} >= 0, \"most_chunks {d}\");\n"
        checks += f"static_assert({room.format(groups + 1)} < 0, \"most_chunks {d} + 1\");\n"
    source = "#include <cuda/std/cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
    result = nvrtc.compile(source + header + checks, arch=ARCH)
    assert result.ok, result.log


def test_broken_body_fails(nvrtc, calls):
    """Negative control: the same pipeline rejects a body that is not valid CUDA."""
    call = calls[("float16", "float16", 128)]
    result = nvrtc.compile(call.cuda_source(source=call.source + "\nmuser_undeclared += 1;\n"),
                           arch=ARCH, name_expressions=[call.name_expression])
    assert not result.ok
    assert 'identifier "muser_undeclared" is undefined' in result.log, result.log


def test_the_timeline_build_compiles_and_the_launch_has_no_stamps(nvrtc, calls):
    """``attention_mma_check.py --timeline`` builds the kernel with
    ``MUSER_ATTEND_TIMELINE`` and one more output: that build must compile (so
    the profile stays at hand), and the launch users run must carry none of it."""
    import dataclasses

    call = calls[("bfloat16", "bfloat16", 128)]
    timed = dataclasses.replace(call, name=call.name + "_timeline",
                                header="#define MUSER_ATTEND_TIMELINE 1\n" + call.header,
                                output_names=call.output_names + ["timeline"],
                                output_dtypes=call.output_dtypes + [mx.uint64])
    result = nvrtc.compile(timed.cuda_source(), arch=ARCH, name_expressions=[timed.name_expression])
    _check_compiled(result, timed)
    assert "%globaltimer" in result.ptx and "%smid" in result.ptx
    plain = nvrtc.compile(call.cuda_source(), arch=ARCH, name_expressions=[call.name_expression])
    assert plain.ok and "%globaltimer" not in plain.ptx


def test_the_first_pass_alone_build_compiles(nvrtc, calls):
    """``attention_mma_check.py`` times the first pass alone by cutting the
    launch's fold-and-combine call out of the header (its ``_TAIL``): that text
    must be the header's call, word for word, and the cut kernel must compile."""
    import dataclasses
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import attention_mma_check

    call = calls[("bfloat16", "bfloat16", 128)]
    assert call.header.count(attention_mma_check._TAIL) == 1
    first = dataclasses.replace(call, name=call.name + "_first",
                                header=call.header.replace(attention_mma_check._TAIL, ""))
    result = nvrtc.compile(first.cuda_source(), arch=ARCH, name_expressions=[first.name_expression])
    assert result.ok, result.log  # (FOLD unreferenced there: a warning, not an error)


def test_the_text_mlx_gets_is_the_kernel_without_its_comments():
    """MLX builds and hashes a launch's whole source at every call, so the
    launcher hands it the kernel's text compacted (``attention_cuda.compact``):
    the same tokens, line for line, without comments, blank lines or indentation."""
    from pathlib import Path

    def tokens(text):
        return [t for line in text.splitlines() for t in re.sub(r"//.*$", "", line).split()]

    kernels = Path(attention_cuda.__file__).resolve().parents[2] / "kernels"
    for name, built in (("attend_mma.h", attention_cuda.kernel_header()),
                        ("attend_mma.cu", attention_cuda.kernel_source())):
        text = (kernels / name).read_text()
        assert tokens(built) == tokens(text), name
        assert "//" not in built and "\n\n" not in built and "\n " not in built, name
        # a continued macro stays continued: the same lines end in a backslash
        assert sum(x.rstrip().endswith("\\") for x in built.splitlines()) == \
            sum(x.rstrip().endswith("\\") for x in text.splitlines()), name
    assert len(attention_cuda.kernel_header()) < 0.7 * len((kernels / "attend_mma.h").read_text())
    # a comment's slashes inside a string are text, not a comment
    assert attention_cuda.compact('  x = "a // b";  // c\n\n') == 'x = "a // b";  // c\n'
    assert attention_cuda.compact("#define X a \\\n    b\n") == "#define X a \\\nb\n"
    # a cut that would change the text's meaning is refused, not made
    for text in ("#define X a \\\n\nb\n",       # a continued line's next line dropped
                 "#define X a \\\n  // c\nb\n",  # ... a comment line
                 "#define X a \\  \nb\n",         # a backslash before trailing blanks
                 "x = a \\ // c\nb\n"):           # ... before a comment
        with pytest.raises(ValueError, match="compact: line"):
            attention_cuda.compact(text)


def test_params_that_ask_for_sinks_need_sinks():
    """A 9-int header whose sinks flag is set, with no sinks given, would have
    the kernel read past its one-element stand-in: refused before the launch."""
    q = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    kv = mx.zeros((1, 2, 512, 128), mx.bfloat16)
    params = [1, 2, 16, 1, 128, 256, 2, 0, 1, 0, 512, 512, 0, 512]
    with pytest.raises(ValueError, match="ask for sinks"):
        attention_cuda.attend_mma(q, kv, kv, params, 0.1, 2, 16)


def test_the_l2_read_probe_compiles(nvrtc, monkeypatch):
    """``benchmarks/l2_read.py`` (one block's L2 read rate, the question behind
    the tail's design) launches its kernel only on a GPU: here its source, as
    MLX wraps it, compiles for sm_90a, and reads with ``ld.global.cg``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import l2_read

    calls = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", recording_cuda_kernel(calls))
    kernel = l2_read.make_kernel()
    kernel(inputs=[mx.zeros((4096,)), mx.array([2048], mx.int32)], grid=(256, 1, 1),
           threadgroup=(128, 1, 1), output_shapes=[(256,), (4,)], output_dtypes=[mx.float32, mx.uint64])
    result = nvrtc.compile(calls[0].cuda_source(FULL_HEADER), arch=ARCH,
                           name_expressions=[calls[0].name_expression])
    assert result.ok, result.log
    assert "ld.global.cg" in result.ptx and "%globaltimer" in result.ptx
    assert l2_read.parse_cases("1x133x128,16x8.3x64") == [(1, 133.0, 128), (16, 8.3, 64)]
