"""Planes follow the model's dtype; every plane allocates whole 256-row granules.

A bf16 model gets bf16 planes, so its K/V are stored bit for bit as it made
them and attention stays in bf16: logits keep mlx-lm's dtype and equal mlx-lm's
own caches bitwise wherever both sum the same rows in the same order (one
prefill chunk, decode before the ring wraps). Past the wrap our ring's rotation
follows positions (rotation = position % capacity, which restore replay rests on) while
mlx-lm's RotatingKVCache rotates with its write head, so a GPU may sum rows in
another order: there logits are held to WRAP_ULPS bf16 ulps and greedy tokens
must agree wherever the top two are further apart than that (on the CPU both
sum in one order, and every token and logit agrees). Speculative decoding
verifies a draft block in one forward, another kernel than one-token decode, so
it too may flip a near tie in bf16, with mlx-lm's caches as with ours.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_model
from local_tokenizer import tokenizer
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step, speculative_generate_step, stream_generate
from oracle import FullHistory, bits16

import muser_kv
import muser_kv.serving.cli

#: Past the wrap: at most this many bf16 ulps (of the larger magnitude) between
#: our logits and mlx-lm's; 0 observed on the CPU, where both sum in one order.
WRAP_ULPS = 8


def quantized(dtype, bits, group_size=32, seed=0):
    """mlx-lm's kind of quantized checkpoint: uint32 weights, scales in ``dtype``."""
    model = tiny_model(dtype, seed=seed)
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    assert model.model.layers[0].self_attn.k_proj.weight.dtype == mx.uint32
    return model


MODELS = {
    "f32": lambda: tiny_model(mx.float32),
    "f16": lambda: tiny_model(mx.float16),
    "bf16": lambda: tiny_model(mx.bfloat16),
    "bf16-q4": lambda: quantized(mx.bfloat16, 4),
    "bf16-q8": lambda: quantized(mx.bfloat16, 8),
    "f16-q4": lambda: quantized(mx.float16, 4),
}
PLANES = {"f32": mx.float16, "f16": mx.float16, "bf16": mx.bfloat16, "bf16-q4": mx.bfloat16,
          "bf16-q8": mx.bfloat16, "f16-q4": mx.float16}


@pytest.fixture(scope="module")
def models():
    return {name: make() for name, make in MODELS.items()}


def prompt(n, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, 255, n), mx.uint32)


# -- the rule ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_plane_dtype_follows_the_models_attention(models, name):
    model = models[name]
    assert muser_kv.plane_dtype_for(model) == PLANES[name]
    cache = muser_kv.make_prompt_cache(model)
    assert {c.dtype for c in cache} == {PLANES[name]}
    # read off the model itself: the dtype of the K/V its attention hands a cache
    expected = mx.float32 if name == "f32" else PLANES[name]
    assert muser_kv.attention_dtype(model) == expected


def test_plane_dtype_override(models):
    f16 = models["f16"]
    for value in ("bfloat16", "bf16", mx.bfloat16):
        assert {c.dtype for c in muser_kv.make_prompt_cache(f16, plane_dtype=value)} == {
            mx.bfloat16}
    assert {c.dtype for c in muser_kv.make_prompt_cache(
        models["bf16"], plane_dtype="float16")} == {mx.float16}
    for bad in ("float32", mx.float32, "int8", mx.uint16, 16):
        with pytest.raises(ValueError, match="plane_dtype must be float16 or bfloat16"):
            muser_kv.make_prompt_cache(f16, plane_dtype=bad)


def test_bf16_planes_store_the_models_bits_and_round_other_inputs(models):
    """bf16 K/V land unchanged; f32 K/V round to bf16 (nearest even), f16 K/V
    widen then round: checked against the numpy oracle after every write."""
    # one sliding layer, a list of its own (a layer of a longer list is driven with it)
    geometry = muser_kv.MuseGeometry(num_layers=1, window=16, max_context=64, num_heads=2,
                                     kv_heads=2, head_dim=128,
                                     layer_kinds=(muser_kv.LayerKind.SLIDING,))
    c = muser_kv.make_cache_for(geometry, plane_dtype="bfloat16")[0]
    oracle = FullHistory(c.window, mx.bfloat16)
    rng = np.random.default_rng(1)
    for n, dtype in ((5, mx.bfloat16), (9, mx.float32), (3, mx.float16), (1, mx.float32),
                     (1, mx.bfloat16), (12, mx.float32)):
        k, v = (mx.array(rng.standard_normal((1, 2, n, 128)).astype(np.float32) * 3).astype(dtype)
                for _ in range(2))
        c.update_and_fetch(k, v)
        oracle.append(k, v)
        start, ck, cv = c.snapshot()
        s, ok, ov = oracle.live()
        assert start == s and ck.dtype == mx.bfloat16
        np.testing.assert_array_equal(bits16(ck), ok)
        np.testing.assert_array_equal(bits16(cv), ov)


# -- mlx-lm as the client -------------------------------------------------------------


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    mag = np.maximum(np.abs(x), np.finfo(np.float32).tiny)
    return np.exp2(np.floor(np.log2(mag)) - 7)


def run(model, cache, p, n, chunk):
    out = []
    for t, lp in generate_step(p, model, prompt_cache=cache, max_tokens=n, prefill_step_size=chunk):
        out.append((int(t), lp))
    return out


def compare_runs(ours, theirs, window, prompt_len):
    """Tokens equal (or a near tie); logits bitwise before the wrap, within
    WRAP_ULPS after it. Returns how many steps were compared bitwise."""
    exact = 0
    for step, ((ta, la), (tb, lb)) in enumerate(zip(ours, theirs)):
        assert la.dtype == lb.dtype == mx.bfloat16, (la.dtype, lb.dtype)
        a, b = np.array(la.astype(mx.float32)), np.array(lb.astype(mx.float32))
        rows = prompt_len + step  # positions written when these logits were made
        if rows <= window:
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}: not bitwise before the wrap")
            exact += 1
        else:
            bound = WRAP_ULPS * bf16_ulp(np.maximum(np.abs(a), np.abs(b)))
            assert np.all(np.abs(a - b) <= bound), f"step {step}: beyond {WRAP_ULPS} bf16 ulps"
        if ta != tb:
            assert near_tie(b), f"step {step}: greedy tokens differ at a clear margin"
            break
    return exact


def near_tie(logprobs: np.ndarray) -> bool:
    """The top two log-probabilities are within WRAP_ULPS bf16 ulps."""
    top2 = np.sort(logprobs)[-2:]
    return bool(top2[1] - top2[0] <= WRAP_ULPS * bf16_ulp(top2[1]))


def cpu() -> bool:
    return mx.default_device() == mx.cpu


@pytest.mark.parametrize("name", ["bf16", "bf16-q4"])
@pytest.mark.parametrize("prompt_len,chunk", [(6, 2048), (50, 7)], ids=["one-chunk", "chunked"])
def test_generate_step_equals_mlx_lm_past_the_wrap(models, name, prompt_len, chunk, mlx_attention):
    model = models[name]
    window = model.args.sliding_window
    p = prompt(prompt_len, seed=prompt_len)
    n = 3 * window  # decode runs the rings through the wrap and around twice more
    ours = run(model, muser_kv.make_prompt_cache(model, max_context=128), p, n, chunk)
    theirs = run(model, model.make_cache(), p, n, chunk)
    exact = compare_runs(ours, theirs, window, prompt_len)
    if prompt_len < window:  # one-chunk prefill, then decode before the wrap: all bitwise
        assert exact == window - prompt_len + 1
    if cpu():  # one summation order: every token agrees
        assert [t for t, _ in ours] == [t for t, _ in theirs]
    out = model(p[None], cache=muser_kv.make_prompt_cache(model, max_context=128))
    assert out.dtype == mx.bfloat16


@pytest.mark.parametrize("name", ["bf16", "bf16-q4"])
def test_stream_generate_equals_mlx_lm(models, name, monkeypatch, mlx_attention):
    """mlx-lm's stream_generate builds its cache with the model's make_cache:
    installing ours there is the drop-in."""
    model = models[name]
    tok = tokenizer(model.args.vocab_size)
    text = " ".join(f"t{i}" for i in np.random.default_rng(4).integers(0, 255, 9))
    n = 3 * model.args.sliding_window

    def tokens():
        return [r.token for r in stream_generate(model, tok, text, max_tokens=n)]

    theirs = tokens()
    with monkeypatch.context() as mp:
        made = []

        def make_cache():
            made.append(muser_kv.make_prompt_cache(model, max_context=128))
            return made[-1]

        mp.setattr(model, "make_cache", make_cache, raising=False)
        ours = tokens()
    assert made and made[0][0].dtype == mx.bfloat16 and made[0][0].ring.wrapped
    if cpu():
        assert ours == theirs
    else:  # up to the first near tie (see the module doc)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        assert first >= model.args.sliding_window - 9  # equal at least until the wrap


def test_speculative_decoding_with_bf16_planes(models, mlx_attention):
    """mlx-lm's speculative_generate_step over bf16 planes yields the greedy
    tokens past the wrap (draft: a noisy copy, so blocks are both kept and undone)."""
    target = models["bf16"]
    draft = tiny_model(mx.bfloat16)  # the target's weights, perturbed: agrees some of the time
    rng = np.random.default_rng(3)
    draft.update(tree_unflatten([
        (k, (v.astype(mx.float32) + mx.array(rng.standard_normal(v.shape), mx.float32) * 0.005)
         .astype(v.dtype)) for k, v in tree_flatten(draft.parameters())]))
    mx.eval(draft.parameters())
    p = prompt(20, seed=5)
    n = 4 * target.args.sliding_window
    greedy = run(target, muser_kv.make_prompt_cache(target, 160), p, n, 2048)
    cache = muser_kv.make_prompt_cache(target, 160) + muser_kv.make_prompt_cache(draft, 160)
    assert {c.dtype for c in cache} == {mx.bfloat16}
    out = list(speculative_generate_step(p, target, draft, prompt_cache=cache, max_tokens=n,
                                         num_draft_tokens=3, prefill_step_size=7))
    tokens = [int(t) for t, _, _ in out]
    assert any(a for _, _, a in out) and not all(a for _, _, a in out)
    assert cache[0].ring.wrapped
    for step, (t, (g, lp)) in enumerate(zip(tokens, greedy)):
        if t != g:  # only a near tie may flip (see the module doc); never on the CPU
            assert not cpu() and near_tie(np.array(lp.astype(mx.float32))), (
                f"step {step}: speculative token {t} != greedy {g} at a clear margin")
            break
    else:
        assert len(tokens) == len(greedy)


def test_checkpoint_rollback_restores_bf16_planes_bitwise(models):
    model = models["bf16"]
    cache = muser_kv.make_prompt_cache(model, max_context=128)
    model(prompt(37, seed=2)[None], cache=cache)
    mx.eval([c.state for c in cache])
    before = [(c.meta_state, bits16(c.state[0]), bits16(c.state[1])) for c in cache]
    cp = muser_kv.checkpoint(cache, block_len=5)
    for t in (3, 9, 27, 81, 243):
        model(mx.array([[t]]), cache=cache)
    assert cp.rollback() == 5
    for c, (meta, k, v) in zip(cache, before):
        assert c.meta_state == meta
        if c.kind is muser_kv.LayerKind.SLIDING:  # the whole ring, rotation included
            np.testing.assert_array_equal(bits16(c.state[0]), k)
            np.testing.assert_array_equal(bits16(c.state[1]), v)


def test_slot_pool_serves_a_bf16_model(models):
    model = models["bf16"]
    pool = muser_kv.SlotPool(model, slots=2, max_context=128, prefill_chunk=7)
    assert pool.plane_dtype == mx.bfloat16
    assert {c.dtype for c in pool.slot(0).cache} == {mx.bfloat16}
    ids = prompt(40, seed=6).tolist()
    got = pool.prefill(0, [muser_kv.Message("user", ids)])
    step = pool.decode(0, 17)
    fresh = muser_kv.make_prompt_cache(model, max_context=128)
    for s in range(0, 40, 7):
        logits = model(mx.array([ids[s:s + 7]]), cache=fresh)
    again = model(mx.array([[17]]), cache=fresh)
    assert got.logits.dtype == mx.bfloat16
    np.testing.assert_array_equal(bits16(got.logits), bits16(logits[0, -1]))
    np.testing.assert_array_equal(bits16(step), bits16(again[0, -1]))


# -- sessions carry the encoding ------------------------------------------------------


def test_bf16_session_round_trip_and_encoding_refusals(models, tmp_path, capsys):
    bf16, f16 = models["bf16"], models["f16"]
    live = muser_kv.make_prompt_cache(bf16, max_context=128)
    bf16(prompt(41, seed=8)[None], cache=live)
    path = tmp_path / "bf16.safetensors"
    assert muser_kv.save_session(path, live).encoding == "bf16le"
    snap = muser_kv.SessionSnapshot.capture(live)
    restored = muser_kv.load_session(path, bf16)
    for a, b in zip(live, restored):
        assert a.meta_state == b.meta_state and b.dtype == mx.bfloat16
        np.testing.assert_array_equal(bits16(a.state[0]), bits16(b.state[0]))
    # genuine safetensors: MLX's own loader reads the BF16 tensors
    arrays, meta = mx.load(str(path), return_metadata=True)
    assert meta["encoding"] == "bf16le" and arrays["layers.0.keys"].dtype == mx.bfloat16
    assert muser_kv.serving.cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "encoding: bf16le (bfloat16 planes)" in out and "bfloat16" in out

    # bf16 into f16 planes, f16 into bf16 planes: refused unless asked to convert
    with pytest.raises(muser_kv.ProductionF16Required, match="bf16le.*convert=True"):
        muser_kv.load_session(path, bf16, plane_dtype="float16")
    f16_live = muser_kv.make_prompt_cache(f16, max_context=128)
    f16(prompt(41, seed=8)[None], cache=f16_live)
    f16_path = tmp_path / "f16.safetensors"
    muser_kv.save_session(f16_path, f16_live)
    # (another model's file: the fingerprint check is waived to reach the encoding's)
    with pytest.raises(muser_kv.EncodingMismatch, match="f16le.*bfloat16.*convert=True"):
        muser_kv.load_session(f16_path, bf16, allow_other_model=True)
    target = muser_kv.make_prompt_cache(bf16, max_context=128)
    before = [bits16(c.state[0]) for c in target]
    with pytest.raises(muser_kv.EncodingMismatch):
        muser_kv.read_session(f16_path).install(target, allow_other_model=True)
    for c, b in zip(target, before):  # refused: nothing changed
        np.testing.assert_array_equal(bits16(c.state[0]), b)
        assert c.offset == 0
    # with convert=True the rows are rounded to the target type (nearest even)
    converted = muser_kv.load_session(path, bf16, plane_dtype="float16", convert=True)
    _, k, _ = converted[0].snapshot()
    assert k.dtype == mx.float16
    np.testing.assert_array_equal(bits16(k), bits16(snap.layers[0].keys.astype(mx.float16)))
    f32_path = tmp_path / "f32.safetensors"
    muser_kv.save_session(f32_path, live, encoding="f32le")
    with pytest.raises(muser_kv.EncodingMismatch, match="f32le"):
        muser_kv.load_session(f32_path, bf16)
    exact = muser_kv.load_session(f32_path, bf16, convert=True)  # bf16 -> f32 -> bf16: exact
    for a, b in zip(exact, live):
        assert a.meta_state == b.meta_state
        np.testing.assert_array_equal(bits16(a.state[0]), bits16(b.state[0]))
    # and the restored session continues with the live one's logits, bit for bit
    nxt = mx.array([[5]])
    np.testing.assert_array_equal(bits16(bf16(nxt, cache=restored)), bits16(bf16(nxt, cache=live)))


# -- no stride cliff ----------------------------------------------------------------


def test_unaligned_max_context_allocates_granules_and_overflows_exactly(models):
    model = tiny_model(mx.float16, max_position_embeddings=1024)
    cache = muser_kv.make_prompt_cache(model, max_context=1000, preallocate=True)
    geometry = muser_kv.MuseGeometry.from_model_args(model.args, 1000)
    for c in cache:
        rows = c.keys.shape[0] if c.layout == "token_major" else c.keys.shape[1]
        assert rows % 256 == 0 and rows >= c.ring.capacity
        assert c.ring.capacity == (16 if c.kind is muser_kv.LayerKind.SLIDING else 1000)
    assert muser_kv.footprint(geometry, 1000).slot_bytes == sum(c.nbytes for c in cache)
    ids = np.random.default_rng(9).integers(0, 255, 1000)
    for s in range(0, 999, 333):
        model(mx.array(ids[None, s:min(s + 333, 999)]), cache=cache)
    assert cache[0].offset == 999
    model(mx.array(ids[None, 999:1000]), cache=cache)  # position 999: the last one
    mx.eval([c.state for c in cache])
    for c in cache:
        with pytest.raises(muser_kv.ContextOverflow, match="exceeds max_context 1000"):
            c.update_and_fetch(*(mx.zeros((1, 2, 1, 128), mx.float16),) * 2)
        assert c.offset == 1000


def test_from_state_keeps_bf16_planes(models):
    model = models["bf16"]
    cache = muser_kv.make_prompt_cache(model, max_context=128)
    model(prompt(30, seed=3)[None], cache=cache)
    copies = [muser_kv.MuseKVCache.from_state(c.state, c.meta_state) for c in cache]
    assert {c.dtype for c in copies} == {mx.bfloat16}
    nxt = mx.array([[7]])
    np.testing.assert_array_equal(bits16(model(nxt, cache=copies)), bits16(model(nxt, cache=cache)))
    mixed = (cache[0].state[0], cache[0].state[1].astype(mx.float16))
    with pytest.raises(ValueError, match="keys and values alike"):
        muser_kv.MuseKVCache.from_state(mixed, cache[0].meta_state)
