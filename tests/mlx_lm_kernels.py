"""Stand-ins for mlx-lm's fused Metal kernels (``mlx_lm/kernels/``), so that
Muse Spark's forward (``mlx_lm/models/muse_spark.py``) runs off Apple silicon:
on the CPU backend here and in CI (and on CUDA).

mlx-lm 0.32.2's Muse Spark calls seven fused kernels through
``mx.fast.metal_kernel``, which only the Metal backend runs. Each function
below computes what its kernel computes, in plain MLX ops: the same arguments
(names, order, keywords), the same output shapes and dtypes, the same
arithmetic (f32 math, the kernel's roundings to ``T`` where it makes them, in
its order), read off each kernel's Metal source. They are not bitwise copies of
the Metal kernels: reductions sum in another order, and the kernels'
``metal::fast::cos/sin`` and ``exp2`` are approximations of their own. That does
not matter to what the tests use them for: the conformance suite compares
cache against cache on the same forward, so mlx-lm's own caches and muser-kv's
run the identical patched model.

``standins()`` patches the names as Muse Spark imported them (the module
globals of ``mlx_lm.models.muse_spark``: it does ``from ..kernels import ...``)
on a device without Metal, and restores them after; on Apple silicon it
changes nothing, and the real kernels run. ``install()`` patches for the rest
of a process (child processes the tests start: ``muser-kv serve``, the
handoff ranks). ``tests/models/conftest.py`` applies ``standins()`` to every
test under ``tests/models`` but the ones marked ``mlx_lm_metal_kernels``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import mlx.core as mx

# mlx-lm builds its kernels when its kernels package is imported: here, with
# MLX's own mx.fast.metal_kernel, before ``--metal-emulator`` replaces it with
# an emulator that models muser-kv's kernels only (conftest imports this module
# first)
from mlx_lm.models import muse_spark

F32 = mx.float32
#: the names Muse Spark imports from mlx_lm.kernels
NAMES = ("expert_routing", "norm_add_norm", "post_expert_norm_combine", "pre_norm", "qk_norm",
         "qk_norm_rope", "rms_norm_sigmoid_gate")


def _rstd(v: mx.array, eps: float) -> mx.array:
    """``rsqrt(sum(v * v) / D + eps)`` over the last axis of f32 ``v`` (every kernel's norm)."""
    return mx.rsqrt(mx.sum(v * v, axis=-1, keepdims=True) / v.shape[-1] + eps)


def _round(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """``static_cast<T>`` then back to float: one rounding to ``dtype``, the math stays f32."""
    return x.astype(dtype).astype(F32)


def expert_routing(logits: mx.array, expert_bias: mx.array, *, top_k: int, multiplier: float,
                   score_eps: float, route_scale: float) -> List[mx.array]:
    """``expert_routing.py``: scores ``sigmoid(logit * multiplier)`` (as the
    kernel writes it: ``1 / (1 + exp(|x|))``, mirrored for ``x >= 0``); the
    ``top_k`` experts by ``score + bias``, best first, a tie to the lower index;
    their weights the *unbiased* scores over their sum (summed best first)
    plus ``score_eps``, times ``route_scale``. Returns ``[inds (uint32),
    weights (f32)]``, each ``logits.shape[:-1] + (top_k,)``."""
    x = logits.astype(F32) * multiplier
    y = 1.0 / (1.0 + mx.exp(mx.abs(x)))
    score = mx.where(x < 0, y, 1.0 - y)
    biased = score + expert_bias.astype(F32)
    experts = mx.arange(logits.shape[-1])
    inds, picked = [], []
    for _ in range(top_k):
        best = mx.argmax(biased, axis=-1, keepdims=True)  # the first of equal maxima
        inds.append(best)
        picked.append(mx.take_along_axis(score, best, axis=-1))
        biased = mx.where(experts == best, -mx.inf, biased)
    w = mx.concatenate(picked, axis=-1)
    total = mx.zeros(w.shape[:-1] + (1,), F32)
    for k in range(top_k):
        total = w[..., k:k + 1] + total
    return [mx.concatenate(inds, axis=-1).astype(mx.uint32), w / (total + score_eps) * route_scale]


def _pre_norm_rows(s: mx.array, weight: mx.array, eps: float, dtype: mx.Dtype) -> mx.array:
    """The kernels' pre-norm of the f32 stream ``s``: ``T(s * rstd * w)``."""
    return (s * _rstd(s, eps) * weight.astype(F32)).astype(dtype)


def norm_add_norm(branch: mx.array, stream: mx.array, *, alpha: mx.array, beta: mx.array,
                  post_weight: Optional[mx.array], post_eps: float,
                  next_norm: Any) -> Tuple[mx.array, Optional[mx.array]]:
    """``norm_add_norm.py``, ``T = branch.dtype``: the branch, scaled first by
    ``post_weight`` where given (the weight rounded to ``T``, the product
    rounded to ``T``: an input-scale norm), RMS-normed with ``post_eps`` and
    rounded to ``T``; the new f32 stream ``alpha * stream + beta * normed``;
    and, with ``next_norm``, that stream RMS-normed with its eps and weight,
    rounded to ``T`` (else ``None``)."""
    dtype = branch.dtype
    v = branch.astype(F32)
    if post_weight is not None:
        v = _round(_round(post_weight, dtype) * v, dtype)
    n = _round(v * _rstd(v, post_eps), dtype)
    s = alpha.astype(F32) * stream.astype(F32) + beta.astype(F32) * n
    if next_norm is None:
        return s, None
    return s, _pre_norm_rows(s, next_norm.weight, next_norm.eps, dtype)


def pre_norm(stream: mx.array, norm: Any, *, dtype: mx.Dtype) -> mx.array:
    """``norm_add_norm.pre_norm``: the f32 stream RMS-normed with ``norm``'s
    eps and weight, rounded to ``dtype`` (as ``norm_add_norm``'s second output)."""
    return _pre_norm_rows(stream.astype(F32), norm.weight, norm.eps, dtype)


def post_expert_norm_combine(experts: mx.array, weights: mx.array, *, norm_weight: mx.array,
                             eps: float) -> mx.array:
    """``post_expert_norm_combine.py``, ``T = experts.dtype``, experts
    ``(..., K, D)``, weights ``(..., K)``: each expert's output scaled by
    ``norm_weight`` (in f32, not rounded) and RMS-normed; added in order
    ``k = 0 .. K-1`` with its weight rounded to ``T``, the sum rounded to ``T``
    after every add. Returns ``(..., D)`` in ``T``."""
    dtype = experts.dtype
    v = experts.astype(F32) * norm_weight.astype(F32)
    scaled = v * _rstd(v, eps)
    ew = _round(weights, dtype)[..., None]
    acc = mx.zeros(experts.shape[:-2] + experts.shape[-1:], F32)
    for k in range(experts.shape[-2]):
        acc = _round(acc + scaled[..., k, :] * ew[..., k, :], dtype)
    return acc.astype(dtype)


def _qk_rows(qkvg: mx.array, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
             query_scale: float) -> Tuple[mx.array, mx.array]:
    """The q and k heads of each qkvg row (its first ``n_heads + n_kv_heads``
    heads), RMS-normed without a weight and rounded to ``T``; q then scaled by
    ``query_scale`` and rounded again. Both f32 holding ``T`` values."""
    dtype = qkvg.dtype
    heads = qkvg[..., :(n_heads + n_kv_heads) * head_dim].astype(F32)
    heads = heads.reshape(*qkvg.shape[:-1], n_heads + n_kv_heads, head_dim)
    y = _round(heads * _rstd(heads, eps), dtype)
    return _round(y[..., :n_heads, :] * query_scale, dtype), y[..., n_heads:, :]


def qk_norm(qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
            query_scale: float) -> List[mx.array]:
    """``qk_norm.py``: ``[q (..., n_heads, head_dim), k (..., n_kv_heads,
    head_dim)]`` in ``qkvg.dtype`` (``_qk_rows``)."""
    q, k = _qk_rows(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale)
    return [q.astype(qkvg.dtype), k.astype(qkvg.dtype)]


def _positions(tokens: Tuple[int, ...], offset: Union[int, mx.array]) -> mx.array:
    """Each token's position as the kernel's f32 ``pos``: ``l + offset[b]``
    (one offset, or one per row of the flattened leading axes), summed in
    uint32 as the kernel does (``n % seq_len`` is a uint), so a left-padded
    row's negative positions wrap to ~4.29e9 there too. Shape ``tokens + (1, 1)``."""
    if isinstance(offset, mx.array):
        off = offset.reshape(-1).astype(mx.int32)
    else:
        off = mx.array([offset], mx.int32)
    length = tokens[-1]
    rows = math.prod(tokens[:-1])
    per_row = off if off.size > 1 else mx.broadcast_to(off, (rows,))
    pos = mx.arange(length, dtype=mx.int32)[None, :] + per_row[:, None]
    return pos.astype(mx.uint32).astype(F32).reshape(*tokens, 1, 1)


def qk_norm_rope(qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
                 query_scale: float, rope_base: float,
                 offset: Union[int, mx.array]) -> List[mx.array]:
    """``qk_norm_rope.py``: ``qk_norm``'s rounded q and k, then rotated as
    ``mx.fast.rope(traditional=True)`` does (the interleaved layout: pairs
    ``(2i, 2i + 1)``), at positions ``offset + l``, with frequencies
    ``2 ** (-(i / (D / 2)) * log2(base))`` (``log2`` of the f32 base), one
    rounding to ``T``."""
    dtype = qkvg.dtype
    q, k = _qk_rows(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale)
    half = head_dim // 2
    log2_base = mx.array(math.log2(rope_base), F32)
    inv_freq = mx.power(mx.array(2.0, F32), -(mx.arange(half, dtype=F32) / half) * log2_base)
    theta = _positions(qkvg.shape[:-1], offset) * inv_freq  # tokens + (1, half)
    c, s = mx.cos(theta), mx.sin(theta)

    def rotate(x: mx.array) -> mx.array:
        pairs = x.reshape(*x.shape[:-1], half, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        out = mx.stack([even * c - odd * s, even * s + odd * c], axis=-1)
        return out.reshape(x.shape).astype(dtype)

    return [rotate(q), rotate(k)]


def rms_norm_sigmoid_gate(x: mx.array, gate: mx.array, *, eps: float) -> mx.array:
    """``rms_norm_sigmoid_gate.py``: x ``(B, H, L, D)`` (the attention
    output) RMS-normed per head without a weight, times ``sigmoid(gate)``
    (gate ``(B, L, H * D)``, head-major in its last axis), in f32 and rounded
    once to ``x.dtype``; returns ``(B, L, H * D)``."""
    B, H, L, D = x.shape
    v = x.astype(F32)
    n = (v * _rstd(v, eps)).transpose(0, 2, 1, 3)
    sig = 1.0 / (1.0 + mx.exp(-gate.reshape(B, L, H, D).astype(F32)))
    return (n * sig).astype(x.dtype).reshape(B, L, H * D)


STANDINS: Dict[str, Any] = {name: globals()[name] for name in NAMES}


def needed() -> bool:
    """Whether this device lacks the Metal backend mlx-lm's kernels run on."""
    return not mx.metal.is_available()


def _patch(module: Any) -> Dict[str, Any]:
    saved = {name: getattr(module, name) for name in NAMES}
    for name in NAMES:
        setattr(module, name, STANDINS[name])
    return saved


@contextmanager
def standins() -> Iterator[bool]:
    """Muse Spark runs on the stand-ins inside the block, on a device without
    Metal (yields whether it patched); its own imports are restored after."""
    if not needed():
        yield False
        return
    saved = _patch(muse_spark)
    try:
        yield True
    finally:
        for name, value in saved.items():
            setattr(muse_spark, name, value)


def install() -> bool:
    """``standins()`` for the rest of this process (a child the tests start)."""
    if not needed():
        return False
    _patch(muse_spark)
    return True
