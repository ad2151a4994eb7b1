"""The stand-ins for mlx-lm's Metal kernels (``tests/mlx_lm_kernels.py``),
checked where no Metal is needed: every call Muse Spark's forward makes gets
the shapes and dtypes the kernel's own wrapper declares for those arguments;
the forward gives finite logits on mlx-lm's own caches; and each stand-in has
the properties its kernel's source gives it (unit RMS before weights, RoPE the
identity at position 0 and mx.fast.rope's rotation elsewhere, routing weights
that sum to ``route_scale``, ...)."""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.kernels  # noqa: F401  (the submodules below)
import mlx_lm_kernels as standin
import numpy as np
import pytest
from model_zoo import tiny

F32 = mx.float32


def rms(x: mx.array) -> np.ndarray:
    return np.sqrt(np.mean(np.array(x.astype(F32)) ** 2, axis=-1))


class Declared:
    """Stands in for an ``mx.fast.metal_kernel`` object: returns zeros of the
    shapes and dtypes the wrapper asks the kernel for."""

    def __call__(self, *, output_shapes, output_dtypes, **_):
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


@pytest.fixture
def declared(monkeypatch):
    """mlx-lm's kernel wrappers, their kernels replaced by ``Declared``."""
    for name in standin.NAMES:
        module = sys.modules[f"mlx_lm.kernels.{'norm_add_norm' if name == 'pre_norm' else name}"]
        for attr in [a for a in vars(module) if a.endswith("_kernel")]:
            monkeypatch.setattr(module, attr, Declared())
    return {name: getattr(mlx_lm.kernels, name) for name in standin.NAMES}


def shapes(out):
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return type(out).__name__, [None if o is None else (tuple(o.shape), o.dtype) for o in outs]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
def test_every_call_of_the_forward_gets_what_the_kernel_declares(declared, dtype, monkeypatch):
    """Prefill and decode on mlx-lm's own caches: each stand-in's outputs have
    the structure, shapes and dtypes the real wrapper declares for the same
    arguments (its output_shapes / output_dtypes), and the logits are finite."""
    from mlx_lm.models import muse_spark

    called = {}

    def spy(name):
        def call(*args, **kw):
            got = standin.STANDINS[name](*args, **kw)
            assert shapes(got) == shapes(declared[name](*args, **kw)), name
            called[name] = called.get(name, 0) + 1
            return got
        return call

    model = tiny("muse_spark", dtype)
    for name in standin.NAMES:
        monkeypatch.setattr(muse_spark, name, spy(name))
    cache = model.make_cache()
    logits = [model(mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]), cache=cache)]
    logits += [model(mx.array([[t]]), cache=cache) for t in (8, 9)]
    mx.eval(logits)
    assert all(bool(mx.isfinite(x).all()) for x in logits)
    # pre_norm runs only between pipeline stages; every other kernel ran
    assert set(called) == set(standin.NAMES) - {"pre_norm"}
    stream = mx.random.normal((2, 3, 64))
    norm = nn.RMSNorm(64)
    assert shapes(standin.pre_norm(stream, norm, dtype=dtype)) == \
        shapes(declared["pre_norm"](stream, norm, dtype=dtype))


@pytest.mark.mlx_lm_metal_kernels  # the patch under test, not the autouse one
def test_standins_patch_muse_spark_only_without_metal_and_restore_it():
    from mlx_lm.models import muse_spark

    before = {n: getattr(muse_spark, n) for n in standin.NAMES}
    with standin.standins() as patched:
        assert patched == (not mx.metal.is_available())
        if patched:
            assert all(getattr(muse_spark, n) is standin.STANDINS[n] for n in standin.NAMES)
    assert {n: getattr(muse_spark, n) for n in standin.NAMES} == before


def qkvg(tokens=(2, 5), heads=4, kv_heads=2, dim=32, dtype=F32, seed=0):
    mx.random.seed(seed)
    return (3 * mx.random.normal((*tokens, 2 * (heads + kv_heads) * dim))).astype(dtype)


NORM = dict(n_heads=4, n_kv_heads=2, head_dim=32, eps=1e-6, query_scale=5.5)


@pytest.mark.parametrize("dtype", [F32, mx.bfloat16], ids=["f32", "bf16"])
def test_qk_norm_gives_unit_rms_keys_and_queries_at_the_query_scale(dtype):
    x = qkvg(dtype=dtype)
    q, k = standin.qk_norm(x, **NORM)
    tol = 1e-5 if dtype == F32 else 1e-2
    np.testing.assert_allclose(rms(k), 1.0, rtol=tol)
    np.testing.assert_allclose(rms(q), 5.5, rtol=tol)
    # the heads are the first rows of qkvg, head by head
    heads = x[..., : 6 * 32].reshape(2, 5, 6, 32)
    ref = mx.fast.rms_norm(heads.astype(F32), None, 1e-6)
    np.testing.assert_allclose(np.array(k.astype(F32)), np.array(ref[..., 4:, :]), rtol=tol, atol=tol)


def test_rope_is_the_identity_at_position_0_and_mx_fast_ropes_rotation_elsewhere():
    x = qkvg(tokens=(1, 6))
    q0, k0 = standin.qk_norm(x, **NORM)
    q, k = standin.qk_norm_rope(x, **NORM, rope_base=10000.0, offset=0)
    assert np.array_equal(np.array(q[:, 0]), np.array(q0[:, 0]))
    assert np.array_equal(np.array(k[:, 0]), np.array(k0[:, 0]))
    assert not np.allclose(np.array(k[:, 1:]), np.array(k0[:, 1:]))
    for offset in (0, 37):
        q, k = standin.qk_norm_rope(x, **NORM, rope_base=10000.0, offset=offset)
        for got, plain in ((q, q0), (k, k0)):  # (B, L, H, D): rope wants (B, H, L, D)
            want = mx.fast.rope(plain.transpose(0, 2, 1, 3), 32, traditional=True, base=10000.0,
                                scale=1.0, offset=offset).transpose(0, 2, 1, 3)
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
        # a rotation keeps each pair's length: the norms stay
        np.testing.assert_allclose(rms(k), 1.0, rtol=1e-5)


def test_rope_takes_one_offset_per_batch_row():
    x = qkvg(tokens=(3, 4))
    q, k = standin.qk_norm_rope(x, **NORM, rope_base=500.0, offset=mx.array([0, 5, 11]))
    for b, off in enumerate((0, 5, 11)):
        qb, kb = standin.qk_norm_rope(x[b:b + 1], **NORM, rope_base=500.0, offset=off)
        assert np.array_equal(np.array(q[b:b + 1]), np.array(qb))
        assert np.array_equal(np.array(k[b:b + 1]), np.array(kb))


def test_a_negative_position_wraps_as_the_kernels_unsigned_sum_does():
    """A left-padded row's positions below 0 (BatchKVCache's offsets start
    negative) are summed in uint32 by the kernel (``n % seq_len`` is a uint):
    ~4.29e9 in f32, not -2; from 0 on they are the plain positions."""
    pos = standin._positions((2, 3), mx.array([-2, 4]))
    assert pos.shape == (2, 3, 1, 1)
    assert np.array(pos).ravel().tolist() == [float(np.float32(2 ** 32 - 2)),
                                              float(np.float32(2 ** 32 - 1)), 0.0, 4.0, 5.0, 6.0]
    x = qkvg(tokens=(1, 3))
    q, _ = standin.qk_norm_rope(x, **NORM, rope_base=10000.0, offset=-2)
    q_at_0, _ = standin.qk_norm_rope(x[:, 2:], **NORM, rope_base=10000.0, offset=0)
    assert np.array_equal(np.array(q[:, 2:]), np.array(q_at_0))


def test_rms_norm_sigmoid_gate_is_the_head_norm_times_the_gate():
    mx.random.seed(1)
    x = 4 * mx.random.normal((1, 4, 3, 32))
    gate = mx.random.normal((1, 3, 128))
    out = standin.rms_norm_sigmoid_gate(x, gate, eps=1e-6)
    assert out.shape == (1, 3, 128) and out.dtype == F32
    normed = mx.fast.rms_norm(x, None, 1e-6).transpose(0, 2, 1, 3).reshape(1, 3, 128)
    np.testing.assert_allclose(np.array(out), np.array(normed * mx.sigmoid(gate)), rtol=1e-5,
                               atol=1e-6)
    big = standin.rms_norm_sigmoid_gate(x, mx.full(gate.shape, 30.0), eps=1e-6)
    np.testing.assert_allclose(rms(big.reshape(1, 3, 4, 32)), 1.0, rtol=1e-5)


def test_norm_add_norm_adds_the_normed_branch_with_the_gate_weights_and_norms_the_sum():
    mx.random.seed(2)
    branch, stream = 7 * mx.random.normal((1, 3, 64)), mx.random.normal((1, 3, 64))
    alpha, beta = mx.full((64,), 0.5), mx.full((64,), 2.0)
    nxt = nn.RMSNorm(64, eps=1e-5)
    new, normed = standin.norm_add_norm(branch, stream, alpha=alpha, beta=beta, post_weight=None,
                                        post_eps=1e-8, next_norm=nxt)
    want = 0.5 * stream + 2.0 * mx.fast.rms_norm(branch, None, 1e-8)
    np.testing.assert_allclose(np.array(new), np.array(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rms(normed), 1.0, rtol=1e-5)
    assert new.dtype == F32 and normed.dtype == branch.dtype
    # an input-scale weight cancels in the norm where it is uniform
    scaled, none = standin.norm_add_norm(branch, stream, alpha=alpha, beta=beta,
                                         post_weight=mx.full((64,), 4.0), post_eps=1e-8,
                                         next_norm=None)
    assert none is None
    np.testing.assert_allclose(np.array(scaled), np.array(new), rtol=1e-5, atol=1e-6)
    # pre_norm is the same norm of the stream
    assert np.array_equal(np.array(standin.pre_norm(new, nxt, dtype=F32)), np.array(normed))


def test_post_expert_norm_combine_is_the_weighted_sum_of_unit_rms_experts():
    mx.random.seed(3)
    experts = 5 * mx.random.normal((2, 3, 2, 32))
    weights = mx.array([0.25, 0.75])[None, None].astype(F32) * mx.ones((2, 3, 2))
    out = standin.post_expert_norm_combine(experts, weights, norm_weight=mx.ones((32,)), eps=1e-8)
    assert out.shape == (2, 3, 32)
    normed = mx.fast.rms_norm(experts, None, 1e-8)
    want = 0.25 * normed[..., 0, :] + 0.75 * normed[..., 1, :]
    np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-6)
    one = standin.post_expert_norm_combine(experts[..., :1, :], mx.ones((2, 3, 1)),
                                           norm_weight=mx.full((32,), 3.0), eps=1e-8)
    np.testing.assert_allclose(rms(one), 1.0, rtol=1e-5)


def test_expert_routing_picks_by_biased_score_and_weighs_by_the_unbiased_one():
    logits = mx.array([[[0.1, 2.0, -1.0, 0.5], [1.0, 1.0, 1.0, 1.0]]])
    bias = mx.array([0.0, 0.0, 10.0, 0.0])
    inds, weights = standin.expert_routing(logits, bias, top_k=2, multiplier=0.5, score_eps=1e-15,
                                           route_scale=2.0)
    assert inds.dtype == mx.uint32 and weights.dtype == F32 and inds.shape == (1, 2, 2)
    # expert 2 wins by its bias; then the best score; equal scores: the lower index first
    assert np.array(inds).tolist() == [[[2, 1], [2, 0]]]
    score = 1 / (1 + np.exp(-0.5 * np.array(logits)))
    chosen = np.take_along_axis(score, np.array(inds).astype(np.int64), axis=-1)
    np.testing.assert_allclose(np.array(weights), 2.0 * chosen / chosen.sum(-1, keepdims=True),
                               rtol=1e-6)
    np.testing.assert_allclose(np.array(weights).sum(-1), 2.0, rtol=1e-6)
    assert math.isclose(float(weights[0, 0, 0]), 2.0 * score[0, 0, 2] / (score[0, 0, 2] + score[0, 0, 1]),
                        rel_tol=1e-6)
