"""CI compiles and runs the Metal form of every kernel: MLX's own generated text
(``metal_text``), compiled by clang++ behind the MSL shim with strict warnings
fatal, executed on the CPU over the whole grid in guarded buffers, twice
(``metal_emulator``), and compared bitwise with the reference path.

Everything goes through ``KernelBackend("metal")`` with ``mx.fast.metal_kernel``
replaced by the emulator, so the instantiations, params, grids and input views
are exactly the ones the package asks Metal for. Negative controls feed the same
pipeline deliberately broken bodies and assert that each breakage is caught.

clang++ (>= 17; CI installs clang-19) is needed: without it these tests skip on a
developer's machine, and fail where MUSER_KV_REQUIRE_CLANG is set (.ci/run sets
it; the ``emulator`` fixture is in conftest).
"""

import mlx.core as mx
import numpy as np
import pytest
from kernel_cases import (
    CASES,
    DTYPES,
    KV,
    LAYOUTS,
    PLANES,
    RING_STATES,
    ROWS,
    D,
    H,
    bits16,
    edge_values,
    model_kv,
    plane_buffer,
    ring,
)
from metal_emulator import (
    REAL_METAL_KERNEL,
    MetalCompileError,
    MetalEmulatorError,
    MetalFault,
    MetalRunMismatch,
)
from metal_text import MetalTextError, jit_preamble, preamble_identifiers

from muser_kv.core import kernels
from muser_kv.core.kernels import HEAD_MAJOR, TOKEN_MAJOR, KernelBackend, ReferenceBackend

REF = ReferenceBackend()


@pytest.fixture
def metal(emulator, monkeypatch):
    """The package's Metal backend, its kernels built by the emulator."""
    monkeypatch.setattr(mx.fast, "metal_kernel", emulator)
    return KernelBackend("metal")


def assert_bits(got, expect, what=""):
    assert got.dtype == expect.dtype, (what, got.dtype, expect.dtype)
    assert tuple(got.shape) == tuple(expect.shape), (what, got.shape, expect.shape)
    if got.dtype in (mx.float16, mx.bfloat16):
        np.testing.assert_array_equal(bits16(got), bits16(expect), err_msg=what)
    else:
        np.testing.assert_array_equal(np.array(got).view(np.uint8), np.array(expect).view(np.uint8),
                                      err_msg=what)


# -- every instantiation, compiled --------------------------------------------------

# (kernel, T, P) -- what the backend can ask for: the element types are the only
# template values (head geometry and layout travel in params); gather and install
# read planes only (no T). 16 instantiations.
EXPECTED = (
    [(k, t, p) for k in ("batch_store", "stage") for t in DTYPES for p in PLANES]
    + [(k, p, p) for k in ("gather", "install") for p in PLANES]
)
# params has fewer than 8 elements (MLX: `constant` memory) for gather and install
# (7), not for batch_store (9) and stage (8): those MLX passes in `device` memory
PARAMS_SPACE = {"batch_store": "device", "stage": "device", "gather": "constant",
                "install": "constant"}
# head geometries: Muse Glimmer's, and one so small that every input has fewer
# than 8 elements and MLX passes it in `constant` memory
GEOMETRIES = {"muse": (H, D), "tiny": (1, 2)}
METAL_TYPES = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t"}


def drive_every_instantiation(backend: KernelBackend, h: int, d: int) -> None:
    """One call of each (kernel, T, P, layout) for head geometry (h, d)."""
    n, capacity = (4, 8) if d > 2 else (1, 3)
    live = ring(capacity, 2, 9) if d > 2 else ring(capacity, 1, 4)
    for p in PLANES.values():
        for t in DTYPES.values():
            kv = model_kv(n, t, 0, "contiguous", h, d)
            for layout in (TOKEN_MAJOR, HEAD_MAJOR):
                r = ring(capacity, 0, 0)
                first, count = r.append_batch(0, n)
                mx.eval(backend.store_with_dest(kv, kv, layout, first, count, r, 0, p))
                planes = plane_buffer(layout, capacity, p, 1, h, d)
                mx.eval(backend.stage(*planes, live, kv, kv, layout))
        for layout in (TOKEN_MAJOR, HEAD_MAJOR):
            planes = plane_buffer(layout, capacity, p, 2, h, d)
            rows = backend.gather(*planes, layout, live)
            mx.eval(rows)
            mx.eval(backend.install(*rows, layout, live, tuple(planes[0].shape)))


@pytest.fixture(scope="module")
def instantiations(emulator):
    """Every call the Metal backend makes, per geometry: {geometry: [Call]}."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "metal_kernel", emulator)
        for geometry, (h, d) in GEOMETRIES.items():
            start = len(emulator.calls)
            drive_every_instantiation(KernelBackend("metal"), h, d)
            out[geometry] = emulator.calls[start:]
    return out


def _key(call):
    """(kernel, T, P) of a recorded call (its text key holds the template)."""
    template = dict(call.key[8])
    plane = template["P"].replace("mlx.core.", "")
    t = template.get("T", template["P"]).replace("mlx.core.", "")
    return (call.kernel.removeprefix("muser_kv_"), t, plane)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_backend_asks_for_every_instantiation(emulator, instantiations, geometry):
    """Each (kernel, T, P) went through MLX's generator, clang and a run, for
    both layouts."""
    got = {_key(c) for c in instantiations[geometry]}
    assert set(EXPECTED) == got, sorted(set(EXPECTED) ^ got)
    texts = {c.function for c in instantiations[geometry]}
    assert len(texts) == len(EXPECTED)
    for call in instantiations[geometry]:
        spaces = dict((n, s) for n, _, s in call.inputs)
        assert spaces.pop("params") == PARAMS_SPACE[_key(call)[0]], call
        if geometry == "tiny":  # every tensor under 8 elements: MLX's `constant` memory
            assert set(spaces.values()) == {"constant"}, call
        else:
            assert set(spaces.values()) == {"device"}, call


def test_one_program_per_kernel_and_type_pair(emulator, instantiations):
    """Both geometries, both layouts: 16 (kernel, template) instantiations, one
    per kernel and type pair. Head geometry or layout back among the template
    values would make more (MLX compiles one program per name and template).
    Metal's text also varies with which inputs MLX passes in `constant` memory
    (the tiny geometry), so the texts of the two geometries differ; within a
    geometry each instantiation has exactly one text, whatever the layout."""
    calls = [c for geometry in GEOMETRIES for c in instantiations[geometry]]
    assert len({(c.kernel, c.key[8]) for c in calls}) == len(EXPECTED) == 16
    assert all({n for n, _ in c.key[8]} <= {"T", "P"} for c in calls)
    for geometry in GEOMETRIES:
        per_key = {}
        for c in instantiations[geometry]:
            per_key.setdefault(_key(c), set()).add(emulator.texts[c.key])
        assert all(len(texts) == 1 for texts in per_key.values()), geometry


@pytest.mark.parametrize("case", EXPECTED, ids=lambda c: "-".join(map(str, c)))
def test_generated_text_is_mlx_signature(emulator, instantiations, case):
    """What MLX generated for the Muse geometry: the template, the inputs in
    `device` memory with `params` in `constant`, MLX's element type names."""
    call = next(c for c in instantiations["muse"] if _key(c) == case)
    text = emulator.texts[call.key]
    kernel, t, p = case
    header = kernels.kernel_header()
    assert text.startswith(header)  # MLX writes the header first, then the template
    assert text[len(header):].startswith(
        "template <typename T, typename P>\n" if kernel in ("batch_store", "stage")
        else "template <typename P>\n")
    assert f"  const {PARAMS_SPACE[kernel]} int32_t* params [[buffer(" in text
    assert "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {" in text
    args = [METAL_TYPES[t], METAL_TYPES[p]] if kernel in ("batch_store", "stage") else [
        METAL_TYPES[p]]
    assert f"<{', '.join(args)}>;\n" in text
    if kernel in ("batch_store", "stage"):
        assert f"  const device {METAL_TYPES[t]}* key [[buffer(" in text
        assert "  const constant int64_t* key_strides [[buffer(" in text


def test_preamble_is_mlx_own(emulator):
    """The preamble comes from the wheel's headers; nothing the kernels define
    (the prelude's and header's macros) names anything in MLX's full preamble."""
    pre = jit_preamble()
    assert "typedef bfloat bfloat16_t;" in pre and "typedef half float16_t;" in pre
    assert "using namespace metal;" in pre and "MTL_CONST" in pre
    names = set()
    for text in (kernels.kernel_source(k) for k in ("batch_store", "stage", "gather", "install")):
        names |= {line.split()[1].split("(")[0] for line in text.splitlines()
                  if line.startswith("#define")}
    header = kernels.kernel_header()
    names |= {line.split()[1].split("(")[0] for line in header.splitlines()
              if line.startswith("#define")}
    names |= {"muser_kv_to_plane", "muser_kv_plane_of"}
    clashes = {n: where for n, where in preamble_identifiers().items() if n in names}
    assert not clashes, clashes
    assert "KIDX_GLOBAL_X" in names and "TO_PLANE" in names


# -- executed, bitwise against the reference ------------------------------------------

@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_batch_store(metal, plane, dtype, layout, case, kv_layout):
    capacity, length, origin, n = case
    r = ring(capacity, length, origin)
    start = r.end
    first, count = r.append_batch(start, n)
    k = model_kv(n, DTYPES[dtype], n + length, kv_layout)
    v = model_kv(n, DTYPES[dtype], n + length + 1, kv_layout)
    got_k, got_v, dest = metal.store_with_dest(k, v, layout, first, count, r, start, PLANES[plane])
    ref_k, ref_v = REF.store(k, v, layout, first, count, dtype=PLANES[plane])
    assert_bits(got_k, ref_k, "key rows")
    assert_bits(got_v, ref_v, "value rows")
    np.testing.assert_array_equal(np.array(dest), [r.physical(start + first + j)
                                                   for j in range(count)])


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kv_layout", ["strided", "broadcast", "reversed"])
def test_stage(metal, rows, plane, dtype, layout, case, kv_layout):
    capacity, length, origin, n = case
    r = ring(capacity, length, origin)
    pk, pv = plane_buffer(layout, ROWS[rows](capacity), PLANES[plane], seed=length)
    k = model_kv(n, DTYPES[dtype], 3, kv_layout)
    v = model_kv(n, DTYPES[dtype], 4, kv_layout)
    got = metal.stage(pk, pv, r, k, v, layout)
    ref = REF.stage(pk, pv, r, k, v, layout)
    assert_bits(got[0], ref[0], "key shadow")
    assert_bits(got[1], ref[1], "value shadow")


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("ring_state", RING_STATES)
def test_gather_and_install(metal, rows, plane, layout, ring_state):
    capacity, length, origin = ring_state
    r = ring(capacity, length, origin)
    pk, pv = plane_buffer(layout, ROWS[rows](capacity), PLANES[plane], seed=length + origin)
    got = metal.gather(pk, pv, layout, r)
    ref = REF.gather(pk, pv, layout, r)
    assert_bits(got[0], ref[0], "key snapshot")
    assert_bits(got[1], ref[1], "value snapshot")
    shape = tuple(pk.shape)
    installed = metal.install(ref[0], ref[1], layout, r, shape)
    expect = REF.install(ref[0], ref[1], layout, r, shape)
    assert_bits(installed[0], expect[0], "installed key plane")
    assert_bits(installed[1], expect[1], "installed value plane")


@pytest.mark.parametrize("kernel", ["batch_store", "stage", "gather_install"])
def test_tiny_geometry_in_constant_memory(metal, kernel):
    """Inputs under 8 elements: MLX declares them `const constant T*`."""
    h, d, n = 1, 2, 3
    for p in PLANES.values():
        for t in DTYPES.values():
            k, v = model_kv(n, t, 5, "strided", h, d), model_kv(n, t, 6, "reversed", h, d)
            r = ring(3, 2, 4)
            if kernel == "batch_store":
                first, count = r.append_batch(r.end, n)
                got = metal.store_with_dest(k, v, TOKEN_MAJOR, first, count, r, 6, p)
                ref = REF.store(k, v, TOKEN_MAJOR, first, count, dtype=p)
            elif kernel == "stage":
                planes = plane_buffer(HEAD_MAJOR, 3, p, 7, h, d)
                got = metal.stage(*planes, r, k, v, HEAD_MAJOR)
                ref = REF.stage(*planes, r, k, v, HEAD_MAJOR)
            else:
                planes = plane_buffer(TOKEN_MAJOR, 3, p, 8, h, d)
                rows = metal.gather(*planes, TOKEN_MAJOR, r)
                got = metal.install(*rows, TOKEN_MAJOR, r, (3, h * d))
                ref = REF.install(*REF.gather(*planes, TOKEN_MAJOR, r), TOKEN_MAJOR, r, (3, h * d))
            assert_bits(got[0], ref[0])
            assert_bits(got[1], ref[1])
    for name in (["gather", "install"] if kernel == "gather_install" else [kernel]):
        text = metal.kernel(name).last_text
        device = [line for line in text.splitlines() if "const device" in line]
        assert "const constant" in text, name
        # params (9 or 8 int32: head geometry and layout appended) alone in `device`
        assert all(" params [[buffer(" in line for line in device), (name, device)
        assert bool(device) == (PARAMS_SPACE[name] == "device"), name


@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_conversion_edges_match_mlx(metal, plane, dtype):
    """Ties, +-65504 and overflow, subnormals, -0, NaN (payloads and signs), inf:
    the kernel's conversion gives MLX's bits (the shim converts as MLX's CPU)."""
    k = edge_values((1, H, 8, D), DTYPES[dtype], seed=9)
    got, _, _ = metal.store_with_dest(k, k, TOKEN_MAJOR, 0, 8, ring(8, 0, 0), 0, PLANES[plane])
    ref, _ = REF.store(k, k, TOKEN_MAJOR, 0, 8, dtype=PLANES[plane])
    assert_bits(got, ref)
    if dtype == "float32":  # the NaNs really went through the modelled conversion
        nan = 0x7D00 if plane == "float16" else 0x7FC0
        assert (bits16(got) == nan).any()


# -- the backend is Metal only through the emulator -----------------------------------

def test_detect_never_picks_metal_without_metal(monkeypatch):
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert kernels.detect() == "reference"
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert kernels.detect() == "metal"


@pytest.mark.skipif(mx.metal.is_available(), reason="this MLX has Metal")
def test_metal_backend_without_metal_fails_closed(monkeypatch):
    """Selected by name on Linux with MLX's own factory, the Metal backend refuses
    to run (MLX: "No Metal back-end"); only the tests' emulator runs it here."""
    monkeypatch.setattr(mx.fast, "metal_kernel", REAL_METAL_KERNEL)
    planes = plane_buffer(TOKEN_MAJOR, 16, mx.float16, 0)
    with pytest.raises(RuntimeError, match="No Metal back-end"):
        mx.eval(KernelBackend("metal").gather(*planes, TOKEN_MAJOR, ring(16, 4, 0)))


# -- negative controls: broken bodies are caught ---------------------------------------

def _broken(monkeypatch, emulator, kernel, old, new):
    """A Metal backend whose ``kernel`` source (prelude + body) has ``old``
    replaced by ``new`` (each a string, or a tuple of strings replaced pairwise)."""
    real = kernels.kernel_source
    pairs = list(zip(old, new)) if isinstance(old, tuple) else [(old, new)]

    def source(name):
        text = real(name)
        if name == kernel:
            for a, b in pairs:
                assert a in text, (kernel, a)
                text = text.replace(a, b)
        return text

    monkeypatch.setattr(kernels, "kernel_source", source)
    monkeypatch.setattr(mx.fast, "metal_kernel", emulator)
    return KernelBackend("metal")


def _gather(backend, plane=mx.float16):
    r = ring(16, 16, 11)
    pk, pv = plane_buffer(TOKEN_MAJOR, 16, plane, 3)
    got = backend.gather(pk, pv, TOKEN_MAJOR, r)
    ref = REF.gather(pk, pv, TOKEN_MAJOR, r)
    assert_bits(got[0], ref[0], "key snapshot")
    assert_bits(got[1], ref[1], "value snapshot")


def _store(backend):
    k = model_kv(5, mx.float32, 1, "strided")
    r = ring(16, 14, 0)
    first, count = r.append_batch(r.end, 5)
    got = backend.store_with_dest(k, k, TOKEN_MAJOR, first, count, r, r.end, mx.float16)
    assert_bits(got[0], REF.store(k, k, TOKEN_MAJOR, first, count)[0])


def _install(backend):
    r = ring(16, 5, 0)
    rows = plane_buffer(TOKEN_MAJOR, 5, mx.float16, 4)
    got = backend.install(*rows, TOKEN_MAJOR, r, (256, KV))
    assert_bits(got[0], REF.install(*rows, TOKEN_MAJOR, r, (256, KV))[0])


GATHER_READ = "out_key[tid] = plane_key[src];"
CONTROLS = {
    # name: (kernel, old, new, driver, exception, message)
    "missing-device-qualifier": ("gather", GATHER_READ,
                                 "const P* live = plane_key;\n  out_key[tid] = live[src];",
                                 _gather, MetalCompileError, r"address_space\(1\)"),
    "double": ("gather", GATHER_READ, "const double scale = 1.0;\n  out_key[tid] = plane_key[src];",
               _gather, MetalCompileError, "poisoned"),
    "int64-narrowing": ("batch_store", "const int64_t src_k =", "const uint32_t src_k =",
                        _store, MetalCompileError, "Wshorten-64-to-32"),
    "float-narrowing": ("install", "plane_key[tid] = TO_PLANE(0.0f);",
                        "plane_key[tid] = 0.5f * static_cast<float>(rows_key[0]);",
                        _install, MetalCompileError, "Wimplicit-float-conversion"),
    "local-named-like-an-attribute": (
        "gather", GATHER_READ, "const uint32_t grid_size = 1u;\n  out_key[tid] = plane_key[src + grid_size - 1u];",
        _gather, MetalCompileError, "grid_size"),
    "out-of-bounds-write": ("gather", GATHER_READ, "out_key[tid + 1u] = plane_key[src];",
                            _gather, MetalFault, r"write .*past the end of output `out_key`"),
    "out-of-bounds-read": ("gather", GATHER_READ,
                           "out_key[tid] = plane_key[src + (uint32_t)params[3] * kv_dim];",
                           _gather, MetalFault, r"read .*input `plane_key`"),
    "write-to-an-input": ("gather", GATHER_READ,
                          "out_key[tid] = plane_key[src];\n  const_cast<device P*>(plane_key)[src] = out_key[tid];",
                          _gather, MetalFault, r"write to input `plane_key` at byte \d+"),
    "unwritten-element": ("gather", GATHER_READ, "if (tid != 3u) { out_key[tid] = plane_key[src]; }",
                          _gather, MetalRunMismatch, "output `out_key` differs .* at 1 of"),
    "thread-order-dependence": ("gather", "out_value[tid] = plane_value[src];",
                                "out_value[tid] = tid > 0u ? out_value[tid - 1u] : plane_value[src];",
                                _gather, MetalRunMismatch, "output `out_value` differs"),
    "off-by-one-row": ("gather", "((uint32_t)params[1] + row) % capacity",
                       "((uint32_t)params[1] + row + 1u) % capacity",
                       _gather, AssertionError, "key snapshot"),
    "comment-naming-a-shape": (  # MLX adds a `key_shape` parameter the body never reads
        "batch_store", "const uint32_t kv_dim", "// key_shape is [1, H, N, D]\nconst uint32_t kv_dim",
        _store, MetalCompileError, "unused parameter 'key_shape'"),
    # No thread attribute, a _strides input and several outputs: MLX's generator
    # (0.32.4) then closes the parameter list after the first output.
    "mlx-signature-bug": (
        "batch_store",
        ("#define KIDX_GLOBAL_X ((uint32_t)thread_position_in_grid.x)", "adds `thread_position_in_grid`"),
        ("#define KIDX_GLOBAL_X (0u)", "adds the thread position"),
        _store, MetalTextError, r"parameters are not in MLX's order"),
    # the prelude's comment alone names the attribute: MLX adds it, unused
    "attribute-named-in-a-comment-only": (
        "batch_store", "#define KIDX_GLOBAL_X ((uint32_t)thread_position_in_grid.x)",
        "#define KIDX_GLOBAL_X (0u)", _store, MetalCompileError,
        "unused parameter 'thread_position_in_grid'"),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_broken_body_is_caught(emulator, monkeypatch, control):
    """Negative control: the same pipeline, a deliberately broken body; the check
    that must catch it does."""
    kernel, old, new, drive, error, message = CONTROLS[control]
    backend = _broken(monkeypatch, emulator, kernel, old, new)
    with pytest.raises(error, match=message):
        drive(backend)


def test_unbroken_controls_pass(emulator, monkeypatch):
    """The controls' drivers pass on the real bodies (so a control fails only
    because of its breakage)."""
    monkeypatch.setattr(mx.fast, "metal_kernel", emulator)
    backend = KernelBackend("metal")
    _gather(backend)
    _store(backend)
    _install(backend)


def test_mlx_extra_buffers_are_bound_in_mlx_order(emulator, monkeypatch):
    """A body that reads `key_shape` makes MLX add a `key_shape` buffer right
    after `key` (a substring test); the emulator binds MLX's buffers in MLX's
    order, so the kernel still runs and still matches."""
    backend = _broken(monkeypatch, emulator, "batch_store", "const uint32_t kv_dim",
                      "if (key_shape[1] != params[6]) { dest[0] = -1; }\nconst uint32_t kv_dim")
    _store(backend)
    text = backend.kernel("batch_store").last_text
    assert "  const constant int* key_shape [[buffer(1)]],\n" \
           "  const constant int64_t* key_strides [[buffer(2)]]," in text


def test_emulator_refuses_what_it_does_not_model(emulator):
    with pytest.raises(MetalEmulatorError, match="ensure_row_contiguous"):
        emulator(name="x", input_names=["a"], output_names=["b"], source="")
