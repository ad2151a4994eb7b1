"""muser-kv's decode attention (``core.attention``): its rule for the bits.

A sequence's output must be the same bits however its keys lie -- any
allocation, ring rotation, slot, batch size, order and neighbours' lengths --
and rows it does not hold (NaN here) must never reach it. Each backend is
compared with itself bitwise; the reference with MLX's own attention, and the
Metal form (emulated) with the reference, within rounding: those are other
computations of the same softmax (other summation orders, and MLX's attention
rounds its scores where ours keeps f32), so equal bits are not the promise.
"""

import mlx.core as mx
import numpy as np
import pytest

from muser_kv.core import attention, attention_cuda
from muser_kv.core.attention import CHUNK, DecodeRead, KeyRead
from muser_kv.core.kernels import KernelBackend, get_backend

H, G, D = 2, 4, 64
SCALE = D ** -0.5


def logical_rows(held, seed, dtype=mx.bfloat16, d=D):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((H, held, d)).astype(np.float32)
    v = rng.standard_normal((H, held, d)).astype(np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def lay_out(k, v, rows, origin, slots=1, slot=0, token_major=False, wrap=None):
    """Logical rows ``k``/``v`` ``[H, held, D]`` at rotation ``origin`` of a ring
    of ``rows`` rows, in slot ``slot`` of ``slots``; every other row NaN. As
    attention is handed them: ``[S, H, R, D]`` (a token-major plane's view has
    its own strides)."""
    held, wrap = k.shape[1], wrap or rows
    assert held <= wrap <= rows
    idx = (origin + np.arange(held)) % wrap
    out = []
    for x in (k, v):
        a = np.full((slots, H, rows, x.shape[2]), np.nan, np.float32)
        a[slot][:, idx] = np.array(x.astype(mx.float32))
        arr = mx.array(a).astype(x.dtype)
        if token_major:  # stored [S, R, H, D], viewed as [S, H, R, D]
            arr = mx.contiguous(arr.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        out.append(arr)
    return out[0], out[1]


def queries(b, n, seed, dtype=mx.bfloat16, d=D):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((b, H * G, n, d)).astype(np.float32)).astype(dtype)


def sdpa_oracle(q, k, v, end, n, window):
    """MLX's own attention over the sequence's logical rows, with its mask."""
    held = k.shape[1]
    qpos = end - n + np.arange(n)[:, None]
    pos = end - held + np.arange(held)[None]
    seen = pos <= qpos
    if window:
        seen &= pos > qpos - window
    return mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), k[None].astype(mx.float32), v[None].astype(mx.float32),
        scale=SCALE, mask=mx.array(seen))


CASES = [  # (end, held, n, window)
    (1, 1, 1, None), (300, 300, 1, None), (1000, 1000, 1, None), (777, 777, 4, None),
    (4100, 64, 1, 64), (5000, 256, 1, 256), (600, 259, 4, 256), (90, 90, 16, 2048),
    (4500, 4500, 2, None),  # more than FOLD chunks: the kernels fold them first
]


@pytest.mark.parametrize("end,held,n,window", CASES)
def test_the_reference_is_mlx_attention_within_rounding(end, held, n, window):
    k, v = logical_rows(held, end)
    q = queries(1, n, end)
    read = DecodeRead(*lay_out(k, v, held, 0), (KeyRead(0, end, held, 0, held),), window)
    got = attention.reference(q, read, SCALE)
    want = sdpa_oracle(q, k, v, end, n, window)
    assert got.dtype == q.dtype and got.shape == q.shape
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), atol=2e-2, rtol=2e-2)


def placements(held):
    """Ways the same rows can lie: (rows allocated, origin, slots, slot, token-major)."""
    up = -(-held // 256) * 256
    yield held, 0, 1, 0, False
    yield up, 0, 1, 0, False
    yield up * 4, 0, 3, 2, False
    yield held, held // 3, 1, 0, True
    yield up, up - 1, 2, 1, True
    yield up * 2, 5, 1, 0, False


def bits(x):
    return np.array(x.astype(mx.float32)).view(np.uint32)


def check_invariance(backend, end, held, n, window, dtype=mx.bfloat16):
    k, v = logical_rows(held, end, dtype)
    q = queries(1, n, end, dtype)
    first = None
    for rows, origin, slots, slot, token_major in placements(held):
        kk, vv = lay_out(k, v, rows, origin, slots, slot, token_major)
        read = DecodeRead(kk, vv, (KeyRead(slot, end, held, origin, rows),), window)
        out = backend.attend(q, read, SCALE)
        assert np.isfinite(np.array(out.astype(mx.float32))).all()  # no NaN row was read
        if first is None:
            first = bits(out)
        np.testing.assert_array_equal(bits(out), first, err_msg=f"{rows} {origin} {slots} {slot}")
    # beside other sequences of other lengths, in a batch of any size and order
    others = [(37, 37), (2 * CHUNK + 3, 2 * CHUNK + 3), (held + 500, held)]
    for order in (0, 1, 3):
        lens = others[:order] + [(end, held)] + others[order:]
        rows = max(h for _, h in lens) + 256
        ks, vs, reads, qs = [], [], [], []
        for b, (e, h) in enumerate(lens):
            if (e, h) == (end, held) and b == order:
                kb, vb, qb = k, v, q
            else:
                kb, vb = logical_rows(h, e + 7, dtype)
                qb = queries(1, n, e + 7, dtype)
            origin = (b * 101) % rows
            kl, vl = lay_out(kb, vb, rows, origin)
            ks.append(kl)
            vs.append(vl)
            reads.append(KeyRead(b, e, h, origin, rows))
            qs.append(qb)
        read = DecodeRead(mx.concatenate(ks), mx.concatenate(vs), tuple(reads), window)
        out = backend.attend(mx.concatenate(qs), read, SCALE)
        np.testing.assert_array_equal(bits(out[order:order + 1]), first, err_msg=f"batch {lens}")
    return first


@pytest.mark.parametrize("end,held,n,window", CASES)
def test_a_sequence_gets_the_same_bits_however_its_keys_lie(end, held, n, window):
    backend = get_backend()
    first = check_invariance(backend, end, held, n, window)
    again = check_invariance(backend, end, held, n, window)  # run after run
    np.testing.assert_array_equal(first, again)


def test_a_sink_joins_the_denominator():
    """GPT-OSS's per-head sink logit: the reference against the softmax with a
    sink column written out."""
    end, held, n = 300, 300, 1
    k, v = logical_rows(held, 1, mx.float32)
    q = queries(1, n, 1, mx.float32)
    sinks = mx.array(np.linspace(-1, 3, H * G).astype(np.float32))
    read = DecodeRead(*lay_out(k, v, held, 0), (KeyRead(0, end, held, 0, held),), None)
    got = np.array(attention.reference(q, read, SCALE, sinks))
    qq = np.array(q)[0].reshape(H, G, n, D)
    s = np.einsum("hgnd,hkd->hgnk", qq, np.array(k)) * SCALE
    s = np.concatenate([s, np.broadcast_to(np.array(sinks).reshape(H, G, 1, 1), (H, G, n, 1))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("hgnk,hkd->hgnd", p[..., :-1], np.array(v)).reshape(1, H * G, n, D)
    # f32 throughout, but a GPU's f32 matmul may round its inputs (TF32)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)


def test_queries_that_do_not_fit_are_refused():
    """Another batch, a head count that is no whole GQA group: refused; more
    than MAX_QUERIES tokens: refused by the kernels' check (the reference
    takes any number, 16 at a time)."""
    k, v = logical_rows(40, 0)
    read = DecodeRead(*lay_out(k, v, 40, 0), (KeyRead(0, 40, 40, 0, 40),), None)
    for q in (queries(2, 1, 0), mx.zeros((1, 3, 1, D), mx.bfloat16)):
        with pytest.raises(ValueError, match="decode attention"):
            attention.reference(q, read, SCALE)
    with pytest.raises(ValueError, match="1 to 16 tokens"):
        attention.check_queries(queries(1, 17, 0), read)
    whole = attention.reference(queries(1, 33, 0), read, SCALE)  # 16 + 16 + 1
    alone = [attention.reference(queries(1, 33, 0)[:, :, i:i + 1], DecodeRead(
        read.keys, read.values, (KeyRead(0, 40 - 32 + i, 40 - 32 + i, 0, 40),), None), SCALE)
        for i in (0, 15, 16, 32)]
    for i, one in zip((0, 15, 16, 32), alone):  # each token's answer is its own
        np.testing.assert_array_equal(bits(whole[:, :, i:i + 1]), bits(one))


@pytest.fixture
def metal(emulator, monkeypatch):
    """The Metal form of the kernels, executed by the emulator."""
    monkeypatch.setattr(mx.fast, "metal_kernel", emulator)
    return KernelBackend("metal")


@pytest.mark.parametrize("end,held,n,window", [c for c in CASES if c[0] <= 1000 or c[1] > 4000])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_metal_kernels_keep_the_rule_and_agree_with_the_reference(metal, end, held, n, window,
                                                                     dtype):
    first = check_invariance(metal, end, held, n, window, dtype)
    k, v = logical_rows(held, end, dtype)
    q = queries(1, n, end, dtype)
    read = DecodeRead(*lay_out(k, v, held, 0), (KeyRead(0, end, held, 0, held),), window)
    want = attention.reference(q, read, SCALE)
    got = first.view(np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, np.array(want.astype(mx.float32)), atol=1e-2, rtol=1e-2)


def test_the_metal_combine_takes_the_sinks(metal):
    k, v = logical_rows(300, 3)
    q = queries(1, 1, 3)
    sinks = mx.array(np.linspace(-1, 3, H * G).astype(np.float32))
    read = DecodeRead(*lay_out(k, v, 300, 7), (KeyRead(0, 300, 300, 7, 300),), None)
    got = metal.attend(q, read, SCALE, sinks)
    want = attention.reference(q, read, SCALE, sinks)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               atol=1e-2, rtol=1e-2)


def test_the_cuda_kernels_compile_with_nvrtc(monkeypatch):
    """Every instantiation the CUDA backend asks for, compiled by NVRTC for the
    H200 as MLX would, with a clean log: the tensor cores' one launch for
    queries of each input type over planes of each type (6), and for a
    head_dim they are not built for, the portable first pass (6), the fold
    and the combine by output type (1 + 3)."""
    import os

    from nvrtc import Nvrtc, NvrtcUnavailable, recording_cuda_kernel

    try:
        nvrtc = Nvrtc()
    except NvrtcUnavailable as e:
        if os.environ.get("MUSER_KV_REQUIRE_NVRTC") == "1":
            pytest.fail(f"{e} (MUSER_KV_REQUIRE_NVRTC=1)", pytrace=False)
        pytest.skip(str(e))
    calls = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", recording_cuda_kernel(calls))
    monkeypatch.setattr(attention_cuda, "_built", {})
    backend = KernelBackend("cuda")
    for plane in (mx.float16, mx.bfloat16):
        k, v = logical_rows(300, 0, plane)
        read = DecodeRead(*lay_out(k, v, 512, 3, token_major=True), (KeyRead(0, 300, 300, 3, 512),), 256)
        odd = DecodeRead(*lay_out(*logical_rows(4500, 1, plane, d=80), 4608, 0),
                         (KeyRead(0, 4500, 4500, 0, 4608),), None)
        for dtype in (mx.float32, mx.float16, mx.bfloat16):
            backend.attend(queries(1, 2, 0, dtype), read, SCALE, mx.zeros((H * G,)))
            backend.attend(queries(1, 1, 0, dtype, d=80), odd, SCALE)
    programs = {(c.func_name, c.cuda_source()): c for c in calls}
    names = sorted(name for name, _ in programs)
    assert len(programs) == 6 + 6 + 1 + 3, names
    assert sum("attend_mma_d64" in name for name in names) == 6, names
    for call in programs.values():
        result = nvrtc.compile(call.cuda_source(), arch="sm_90", name_expressions=[call.name_expression])
        assert result.ok, f"{call.func_name}: {result.error}\n{result.log}"
        assert result.log.strip() == "", result.log


def test_the_selftest_checks_the_attention_kernels(metal):
    """``muser-kv selftest``'s attention line: the emulated Metal kernels pass
    it, and a kernel whose bits follow the allocation fails it."""
    from muser_kv.core import selftest
    from muser_kv.core.kernels import ReferenceBackend

    report = selftest.check_attention(metal, ReferenceBackend(), heads=8)
    assert report.ok and report.cases == 12, report.failures

    class FollowsTheAllocation(ReferenceBackend):
        def attend(self, queries, read, scale, sinks=None):
            out = super().attend(queries, read, scale, sinks)
            return out + read.keys.shape[2] * 1e-3  # bits that depend on the rows allocated

    bad = selftest.check_attention(FollowsTheAllocation(), ReferenceBackend(), heads=8)
    assert bad.failures and "another placement" in bad.failures[0]


def test_every_rotation_allocation_and_slot_gives_the_same_bits():
    """A full ring of 256 rows (window 256) at every origin (every 17th on the
    CPU), in planes of 256 x 2^k rows for k = 0..3, in each of three slots,
    run after run (ten times on a GPU): one output, bit for bit."""
    backend = get_backend()
    gpu = backend.name != "reference"
    end, held, window = 1000, 256, 256
    k, v = logical_rows(held, 5)
    q = queries(1, 1, 5)
    first = None
    for origin in range(0, held, 1 if gpu else 17):
        for rows in (256, 512, 1024, 2048):
            slot = (origin + rows // 256) % 3
            # a ring of 256 (its capacity) in planes allocated `rows`
            kk, vv = lay_out(k, v, rows, origin, 3, slot, bool(origin % 2), wrap=held)
            read = DecodeRead(kk, vv, (KeyRead(slot, end, held, origin, held),), window)
            for _ in range(10 if gpu and origin == 0 else 1):
                got = bits(backend.attend(q, read, SCALE))
                if first is None:
                    first = got
                np.testing.assert_array_equal(got, first, err_msg=f"origin {origin} rows {rows}")


def test_each_launch_counts_in_zeros_of_its_own():
    """The CUDA launch's fold counters: zeros of the size asked for, across a
    pool's end and beyond a pool's size."""
    counters = attention_cuda.Counters()
    counters.POOL = 64
    taken = [counters.take(n) for n in (10, 30, 24, 5, 70, 3)]
    assert [t.shape for t in taken] == [(10,), (30,), (24,), (5,), (70,), (3,)]
    assert all(t.dtype == mx.int32 and not bool(mx.any(t).item()) for t in taken)


def test_the_cuda_launch_works_from_any_thread(monkeypatch):
    """serve warms up in one thread and steps in another, and MLX's streams are
    per thread: an array the launcher keeps between calls, made by a lazy op in
    one thread, fails in the next with "There is no Stream(gpu, 0) in current
    thread". Here the kernel is a stand-in that evaluates its inputs."""
    import threading

    def evaluating_kernel(**_):
        def launch(inputs, output_shapes, output_dtypes, **__):
            mx.eval(inputs)
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return launch

    monkeypatch.setattr(mx.fast, "cuda_kernel", evaluating_kernel)
    monkeypatch.setattr(attention_cuda, "_built", {})
    counters = attention_cuda.Counters()
    counters.take(4)  # the pool is made in this thread, and nothing evaluates it here
    k, v = logical_rows(300, 0)
    read = DecodeRead(*lay_out(k, v, 512, 3), (KeyRead(0, 300, 300, 3, 512),), None)
    params = attention_cuda.kernel_params(1, H, G, 1, D, CHUNK, 2, 0, read.sequences)
    q = queries(1, 1, 0)
    mx.eval(q, read.keys, read.values)  # the test's own arrays, ready for any thread
    errors = []

    def step():
        try:
            mx.eval(counters.take(4))
            mx.eval(attention_cuda.attend_mma(q, read.keys, read.values, params, SCALE, 2, G))
        except Exception as e:  # the failure is the test's finding: keep it for the assert
            errors.append(repr(e))

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert errors == []
