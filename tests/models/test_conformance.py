"""One conformance suite over every sliding-window family muser-kv serves
(``tests/model_zoo.py``: tiny random-weight models from each mlx-lm module's own
``ModelArgs``, windows of 8 so a few dozen tokens wrap every ring), f16 and bf16
(Muse Spark, a bf16 model, in bf16; off Apple silicon its forward runs on the
stand-ins for mlx-lm's Metal kernels, ``tests/mlx_lm_kernels.py``).

For every model, against mlx-lm's own caches (its ``make_cache()``) and its own
code paths: the list muser-kv builds is the model's list, entry for entry;
greedy decoding before and past the wrap gives the same tokens with logits
bitwise (the dtypes match); speculative decoding past the wrap equals greedy;
``trim`` is exact up to ``trimmable_depth()`` and refused past it; session
files and mlx-lm's prompt-cache files round-trip bit for bit; ``BatchGenerator``
batches equal solo runs; the footprint is the planes' bytes, per layer kind.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np
import pytest
from metal_plugin import EMULATOR_ENV
from mlx_lm.generate import BatchGenerator, generate_step, speculative_generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from model_zoo import MAX_CONTEXT, REFUSED, WINDOW, ZOO, tiny
from oracle import bits16

import muser_kv
from muser_kv import LayerKind

#: every model the zoo builds (Muse Spark's forward calls mlx-lm's own Metal
#: kernels: without Metal it runs on the tests' stand-ins, ``mlx_lm_kernels``,
#: which conftest's autouse fixture patches in for every test here)
RUNNABLE = list(ZOO)
DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16}
PROMPT = [(7 * i) % 100 + 1 for i in range(13)]  # longer than the window: the prefill wraps
STEPS = 20


PARAMS = [(n, d) for n in RUNNABLE for d in DTYPES if d in ZOO[n].dtypes]


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{n}-{d}" for n, d in PARAMS])
def model(request):
    name, dtype = request.param
    return tiny(name, DTYPES[dtype])


def greedy(model, cache, prompt=PROMPT, n=STEPS, **kw):
    """Tokens and log-probabilities (as f32 numpy) of mlx-lm's generate_step."""
    out = []
    gen = generate_step(mx.array(prompt, mx.uint32), model, prompt_cache=cache, max_tokens=n, **kw)
    for (t, lp), _ in zip(gen, range(n)):
        out.append((int(t), np.array(lp.astype(mx.float32))))
    return out


ON_GPU = mx.default_device() != mx.cpu
#: on a GPU two forwards that take the same rows through other kernels (a
#: prefill against decode steps, a strided view against a contiguous one, a
#: batch against one sequence) may round differently: tokens may part at a
#: near tie of the reference's log-probabilities, never at a clear margin
NEAR_TIE = 0.07


def assert_same_tokens(got, want, what):
    """``got`` equals ``want`` (a ``greedy`` result): bit for bit on the CPU, or,
    on a GPU only, up to a first difference at a near tie of ``want``."""
    tokens = [t for t, _ in want]
    if got == tokens:
        return
    first = next(i for i, (a, b) in enumerate(zip(got + [None], tokens + [None])) if a != b)
    assert ON_GPU, f"{what}: tokens differ at {first} on the CPU"
    top2 = np.sort(want[first][1])[-2:]
    assert top2[1] - top2[0] < NEAR_TIE, f"{what}: tokens differ at {first} at a clear margin"


def logit_bits(x):
    """The bit patterns of a forward's logits: the model's dtype, or f32 (Muse
    Spark's soft-capped logits)."""
    return np.array(x.view(mx.uint32)) if x.dtype == mx.float32 else bits16(x)


def ours(model, **kw):
    return muser_kv.make_prompt_cache(model, MAX_CONTEXT, **kw)


def rows(cache):
    """Every layer's ring state and live rows in logical order, as bits."""
    out = []
    for c in cache:
        start, k, v = c.snapshot()
        out.append((c.meta_state, start, bits16(k).tobytes(), bits16(v).tobytes()))
    return out


def test_the_list_is_the_models_own_entry_for_entry(model):
    own = type(model).make_cache(model)
    cache = ours(model)
    assert len(cache) == len(own)
    for c, o in zip(cache, own):
        if type(o).__name__ == "RotatingKVCache":
            assert (c.kind, c.window) == (LayerKind.SLIDING, o.max_size)
        else:
            assert type(o).__name__ == "KVCache" and c.kind is LayerKind.GLOBAL
    model(mx.array([PROMPT[:3]]), cache=own)  # the planes hold what mlx-lm's caches hold
    assert {c.dtype for c in cache} == {o.keys.dtype for o in own}


def test_greedy_before_the_wrap_equals_mlx_lms_caches_bitwise(model, mlx_attention):
    """Every position inside the window: the same rows in the same order as
    mlx-lm's caches, so the same logits, bit for bit."""
    prompt = PROMPT[:3]
    n = WINDOW - len(prompt) + 1  # the last step attends over exactly the window
    theirs = greedy(model, type(model).make_cache(model), prompt, n)
    mine = greedy(model, ours(model), prompt, n)
    assert_same_tokens([t for t, _ in mine], theirs, "muser-kv against mlx-lm")
    if ON_GPU:  # strided plane views and mlx-lm's contiguous buffers take other kernels
        return
    for i, ((_, a), (_, b)) in enumerate(zip(mine, theirs)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"step {i}: logits differ"


@pytest.mark.parametrize("prompt", [PROMPT[:5], PROMPT], ids=["short-prompt", "wrapping-prompt"])
def test_greedy_past_the_wrap_gives_mlx_lms_tokens(model, prompt, mlx_attention):
    """Past the wrap the rings hold the same rows as mlx-lm's, but mlx-lm's
    RotatingKVCache keeps them in another physical order (after a prefill longer
    than its window, and as it rotates), and attention sums rows in physical
    order: the logits may differ in their last bits (float addition does not
    associate), so they are compared within a few bf16 ulps; the tokens equal.
    Exactness past the wrap is what the other tests pin, bit for bit, against
    muser-kv's own live lists."""
    theirs = greedy(model, type(model).make_cache(model), prompt)
    mine = greedy(model, ours(model), prompt)
    assert_same_tokens([t for t, _ in mine], theirs, "muser-kv against mlx-lm")
    if [t for t, _ in mine] != [t for t, _ in theirs]:
        return  # parted at a near tie (GPU): the logits after it are other sequences'
    worst = max(float(np.max(np.abs(a - b))) for (_, a), (_, b) in zip(mine, theirs))
    assert worst < 0.25, f"log-probabilities differ by up to {worst}"


def test_speculative_decoding_past_the_wrap_equals_greedy(model, request):
    """mlx-lm's speculative_generate_step, with the caches it builds itself
    (``install``: mlx-lm splits a handed prompt_cache at len(model.layers),
    which a model with cacheless layers, Gemma 4, does not fill), past the
    wrap; the draft is another random model of the family, so nearly every
    round is rolled back through the rings' retained rows."""
    name, dtype = request.node.callspec.params["model"]
    draft = tiny(name, DTYPES[dtype], seed=1)
    want = greedy(model, ours(model))
    for m in (model, draft):
        muser_kv.install(m, max_context=MAX_CONTEXT, num_draft_tokens=3)
    try:
        out = list(speculative_generate_step(mx.array(PROMPT, mx.uint32), model, draft,
                                             max_tokens=STEPS, num_draft_tokens=3))
    finally:
        for m in (model, draft):
            muser_kv.uninstall(m)
    assert_same_tokens([int(t) for t, _, _ in out], want, "speculative against greedy")
    assert sum(not accepted for _, _, accepted in out) > STEPS // 3  # rounds rolled back
    assert len(PROMPT) + STEPS > 2 * WINDOW  # every ring wrapped twice


def test_trim_is_exact_to_its_depth_and_refused_past_it(model):
    """Decode past the wrap, recording the list's rows at every position; a trim
    back by up to ``trimmable_depth()`` gives exactly the rows the same list
    held there, bit for bit (on every backend: the same rows, not a re-run);
    one more is refused and changes nothing."""
    from mlx_lm.models.cache import trim_prompt_cache

    live = ours(model)
    seen = {}
    gen = generate_step(mx.array(PROMPT, mx.uint32), model, prompt_cache=live, max_tokens=STEPS)
    for _, _ in zip(gen, range(STEPS)):
        seen[live[0].offset] = rows(live)
    end = live[0].offset
    depth = min(c.trimmable_depth() for c in live)
    assert depth >= min(muser_kv.DEFAULT_RETAIN, end)
    back = min(depth, WINDOW + 3)  # past a whole window of overwritten rows
    assert end - back in seen
    assert trim_prompt_cache(live, back) == back
    assert rows(live) == seen[end - back]
    before = rows(live)
    deeper = min(c.trimmable_depth() for c in live) + 1
    if deeper <= live[0].offset:
        with pytest.raises(ValueError):
            live[0].trim(deeper)
        assert rows(live) == before


def test_a_session_file_round_trips_bitwise(model, tmp_path):
    live = ours(model)
    greedy(model, live)
    muser_kv.save_session(tmp_path / "s.safetensors", live)
    loaded = muser_kv.load_session(tmp_path / "s.safetensors", model)
    assert rows(loaded) == rows(live)
    step = mx.array([[5]])
    assert np.array_equal(logit_bits(model(step, cache=loaded)),
                          logit_bits(model(step, cache=live)))


def test_a_prompt_cache_file_round_trips_bitwise(model, tmp_path):
    live = ours(model)
    greedy(model, live)
    save_prompt_cache(str(tmp_path / "p.safetensors"), live)
    loaded = load_prompt_cache(str(tmp_path / "p.safetensors"))
    assert rows(loaded) == rows(live)
    step = mx.array([[5]])
    assert np.array_equal(logit_bits(model(step, cache=loaded)),
                          logit_bits(model(step, cache=live)))
    # rebuilt one cache at a time, the list is one unit from its first forward on
    c = loaded[1]
    one = mx.zeros((1, c.kv_heads, 1, c.head_dim), c.dtype)
    with pytest.raises(muser_kv.CacheOutOfStep):
        c.update_and_fetch(one, one)


def test_a_session_of_another_model_type_is_refused(model, tmp_path):
    live = ours(model)
    model(mx.array([PROMPT]), cache=live)
    muser_kv.save_session(tmp_path / "s.safetensors", live)
    other = tiny("muse_glimmer" if model.args.model_type != "muse_glimmer" else "olmo3")
    with pytest.raises((muser_kv.SnapshotError, muser_kv.UnsupportedModel)):
        muser_kv.load_session(tmp_path / "s.safetensors", other)


def test_batch_generator_equals_solo_runs(model, monkeypatch):
    prompts = [PROMPT[:4], PROMPT, PROMPT[2:11]]
    max_tokens = [14, 9, 12]
    want = [greedy(model, ours(model), p, n) for p, n in zip(prompts, max_tokens)]
    monkeypatch.setattr(model, "make_cache", lambda: ours(model, batch_slots=2), raising=False)
    gen = BatchGenerator(model, max_tokens=32, completion_batch_size=2, prefill_batch_size=2,
                         prefill_step_size=5)
    uids = gen.insert(prompts, max_tokens)
    got = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(int(r.token))
    gen.close()
    for u, w in zip(uids, want):
        assert_same_tokens(got[u], w, f"sequence {u} against its solo run")


def test_the_footprint_is_the_planes_bytes_per_layer_kind(model):
    geometry = muser_kv.MuseGeometry.from_model(model, MAX_CONTEXT)
    cache = ours(model)
    fp = muser_kv.footprint(geometry, MAX_CONTEXT)
    assert fp.slot_bytes == sum(c.nbytes for c in cache)
    for kind in LayerKind:
        layers = [c for c in cache if c.kind is kind]
        heads, dim = geometry.dims(kind)
        assert all((c.kv_heads, c.head_dim) == (heads, dim) for c in layers)
        kind_bytes = fp.swa_bytes if kind is LayerKind.SLIDING else fp.nope_bytes
        assert kind_bytes == sum(c.nbytes for c in layers)


@pytest.mark.mlx_lm_metal_kernels  # without the stand-ins: what a user without Metal gets
@pytest.mark.skipif(mx.metal.is_available(), reason="Apple silicon runs mlx-lm's Metal kernels")
def test_without_metal_muse_spark_is_read_but_refused_naming_the_failed_forward():
    """Muse Spark's plan is read like every other (its make_cache()), but its
    forward runs mlx-lm's own fused Metal kernels (qk_norm_rope, ...), so on a
    machine without Metal, mlx-lm's modules as they are, no forward runs:
    make_prompt_cache refuses, naming why, rather than guess the K/V shapes.
    (The suite runs it on the tests' stand-ins for those kernels.) In the
    emulated-Metal run too: mlx-lm's kernels are MLX's own there (conftest
    imports them before the emulator replaces mx.fast.metal_kernel)."""
    from muser_kv.core.probe import own_caches

    model = tiny("muse_spark")
    kinds = [c.kind for c in own_caches(model)]
    assert kinds == (["sliding"] * 3 + ["global"]) * 2
    with pytest.raises(muser_kv.UnsupportedModel, match=r"a lazy one-token forward.*failed on this "
                                                         r"device.*Metal"):
        muser_kv.make_prompt_cache(model, MAX_CONTEXT)


def test_an_f16_muse_spark_attends_in_f32():
    """Why Muse Spark runs the suite in bf16 only (``ZOO[...].dtypes``): its
    forward casts the attention input to bf16 (mlx-lm's muse_spark.py), so with
    f16 weights its projections promote to f32 and hand the caches f32 keys,
    which mlx-lm's caches keep and muser-kv's planes store as f16 (its rule for
    f32 attention): mlx-lm's caches are no bitwise oracle there. In bf16, its
    checkpoints' dtype, the attention is bf16 and so are both caches' rows."""
    from muser_kv.core.precision import attention_dtype

    assert attention_dtype(tiny("muse_spark", mx.float16)) == mx.float32
    assert attention_dtype(tiny("muse_spark", mx.bfloat16)) == mx.bfloat16


@pytest.mark.parametrize("name", REFUSED)
def test_a_model_muser_kv_cannot_serve_exactly_is_refused_naming_why(name):
    """``model_zoo.REFUSED``: tiny configs of modules whose forward does what a
    muser-kv cache cannot answer exactly (another layer reading a cache's rows,
    a sliding mask wider than the layer's own ring, K and V of other widths).
    mlx-lm's own caches run each one (the config is a working model);
    ``make_prompt_cache`` and ``install`` refuse it, naming why, and leave the
    model as it was."""
    species, why = REFUSED[name]
    model = tiny(name, mx.bfloat16)
    own = type(model).make_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=own), model(mx.array([[3]]), cache=own))
    with pytest.raises(muser_kv.UnsupportedModel, match=why):
        muser_kv.make_prompt_cache(model, MAX_CONTEXT)
    with pytest.raises(muser_kv.UnsupportedModel, match=why):
        muser_kv.install(model, max_context=MAX_CONTEXT)
    assert "make_cache" not in vars(model)


#: the zoo's models whose mlx-lm args carry no context length (the real
#: checkpoints' config.json has one; mlx-lm's ModelArgs drops it)
NO_CONTEXT = [n for n in ZOO if "max_position_embeddings" not in ZOO[n].args
              and "max_position_embeddings" not in ZOO[n].args.get("text_config", {})]


def test_the_zoo_has_models_that_name_no_context():
    assert {"cohere2", "gpt_oss"} <= set(NO_CONTEXT)


@pytest.mark.parametrize("name", NO_CONTEXT)
def test_a_model_that_names_no_context_gets_a_list_without_a_preset_bound(name, tmp_path):
    """make_prompt_cache(model) refused Cohere2 and GPT-OSS ("pass max_context")
    where model.make_cache() works. With no bound named, rings hold the window
    and global planes grow with no preset bound: the list is the bounded list
    whose bound is never reached, bit for bit, past a plane's first growth; a
    session of it loads unbounded. Only preallocation, which needs a bound,
    asks for max_context."""
    model = tiny(name, mx.bfloat16 if name == "muse_spark" else mx.float16)
    cache = muser_kv.make_prompt_cache(model)
    assert {c.max_context for c in cache} == {muser_kv.UNBOUNDED_CONTEXT}
    assert [c.capacity for c in cache] == [
        WINDOW if c.kind is LayerKind.SLIDING else muser_kv.UNBOUNDED_CONTEXT for c in cache]
    assert [isinstance(c, muser_kv.SlidingKVCache) for c in cache] == [
        type(o).__name__ == "RotatingKVCache" for o in type(model).make_cache(model)]
    bounded = muser_kv.make_prompt_cache(model, 1024)
    prompt = [(7 * i) % 100 + 1 for i in range(300)]  # past a global plane's first 256 rows
    mine, theirs = greedy(model, cache, prompt, n=4), greedy(model, bounded, prompt, n=4)
    assert [t for t, _ in mine] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(mine, theirs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert [c.nbytes for c in cache] == [c.nbytes for c in bounded]
    path = tmp_path / "s.safetensors"
    muser_kv.save_session(path, cache)
    loaded = muser_kv.load_session(path, model)
    assert [(c.offset, c.max_context) for c in loaded] == [
        (c.offset, muser_kv.UNBOUNDED_CONTEXT) for c in cache]

    for refuse in (lambda: muser_kv.make_prompt_cache(model, preallocate=True),
                   lambda: muser_kv.install(model, preallocate=True),
                   lambda: muser_kv.SlotPool(model),
                   lambda: muser_kv.load_session(path, model, preallocate=True)):
        with pytest.raises(muser_kv.UnsupportedModel,
                           match=r"carry no max_position_embeddings: pass max_context"):
            refuse()
    assert "make_cache" not in vars(model)
    full = muser_kv.make_prompt_cache(model, MAX_CONTEXT, preallocate=True)
    assert sum(c.nbytes for c in full) == muser_kv.footprint(
        muser_kv.MuseGeometry.from_model(model, MAX_CONTEXT), MAX_CONTEXT).slot_bytes


def test_muser_kv_attention_answers_each_layer_as_mlx_attention_does(model, monkeypatch):
    """The tests above compare the caches with mlx-lm's through MLX's attention
    (``mlx_attention``). With muser-kv's own (the default), every attention call
    of a generation past the wrap -- prefill chunks and decode steps, every
    layer, with whatever mask the model built -- answers as MLX's attention
    does over the same keys, values and mask, within rounding (MLX's CPU
    attention rounds its scores to the model's type; muser-kv's keeps them in
    f32). Compared per call, because a model's logits amplify any rounding
    (a mixture of experts' routing flips at a near tie)."""
    from muser_kv.caches import mlx_lm_attention

    cache = ours(model)  # routes the model's attention
    seen = []
    wrapper = mlx_lm_attention.scaled_dot_product_attention

    def both(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        got = wrapper(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if getattr(cache, "decode_read", None) is not None:
            want = mlx_lm_attention.original()(queries, keys, values, cache, scale=scale, mask=mask,
                                               sinks=sinks)
            a, b = (np.array(x.astype(mx.float32)) for x in (got, want))
            seen.append(float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-3))
        return got

    for module in {type(m).__module__ for m in model.modules()}:
        if getattr(sys.modules[module], "scaled_dot_product_attention", None) is wrapper:
            monkeypatch.setattr(sys.modules[module], "scaled_dot_product_attention", both)
    greedy(model, cache, PROMPT, n=WINDOW + 4)
    assert seen and max(seen) < 0.05, f"{len(seen)} calls, worst relative difference {max(seen)}"


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("name", ["gpt_oss", "cohere2"])
def test_install_then_mlx_lm_generate_works_as_on_mlx_lms_caches(name, dtype, mlx_attention):
    """install(model) refused GPT-OSS and Cohere2 ("pass max_context"); now
    mlx-lm's own generate on the installed model gives the text it gives on
    mlx-lm's caches. The prompt is 2 windows + 1 tokens, so the rings hold each
    position at the row mlx-lm's RotatingKVCache does (see
    test_muser_kv_generate_prints_what_mlx_lm_generate_prints)."""
    from local_tokenizer import tokenizer
    from mlx_lm import generate

    model = tiny(name, DTYPES[dtype])
    tok = tokenizer(ZOO[name].args["vocab_size"])
    prompt = " ".join(f"t{i}" for i in range(4, 5 + 2 * WINDOW))
    theirs = generate(model, tok, prompt, max_tokens=STEPS)
    muser_kv.install(model)
    try:
        assert muser_kv.installed(model).max_context == muser_kv.UNBOUNDED_CONTEXT
        assert isinstance(model.make_cache()[0], muser_kv.MuseKVCache)
        assert generate(model, tok, prompt, max_tokens=STEPS) == theirs
    finally:
        muser_kv.uninstall(model)


def test_a_model_that_runs_layers_twice_is_refused():
    """IQuest Loop Coder's make_cache() gives every layer a second, looped cache."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    base = tiny("olmo3")

    class Looped(type(base)):
        def make_cache(self):
            return [KVCache() for _ in self.layers] + [RotatingKVCache(WINDOW) for _ in self.layers]

    with pytest.raises(muser_kv.UnsupportedModel, match=r"builds 16 caches for 8 layers"):
        muser_kv.make_prompt_cache(Looped(base.args), MAX_CONTEXT)


@pytest.mark.parametrize("name", RUNNABLE)
def test_muser_kv_generate_prints_what_mlx_lm_generate_prints(name, tmp_path, capsys, monkeypatch, mlx_attention):
    """The command path: a checkpoint on disk (bf16, the zoo's tiny geometry; its
    config.json has max_position_embeddings, which mlx-lm's args drop for
    Cohere2 and GPT-OSS), mlx-lm's own generate main() on muser-kv's caches
    against mlx-lm's, in this process; the session holds every token.

    The prompt is 2 windows + 1 tokens: mlx-lm prefills all but the last, so
    its RotatingKVCache then holds each position p at row p % window, as
    muser-kv's rings do, and both attend over their rows in the same order past
    the wrap: the same logits bit for bit, so the same text whatever the ties.
    (At another rotation the logits may differ in their last bits, and a
    near tie of a tiny random model's logits flips a token: Muse Spark's did,
    at 13 prompt tokens; ``test_greedy_past_the_wrap_gives_mlx_lms_tokens``.)"""
    import importlib

    from local_model import write_local_model

    from muser_kv.serving.cli import main as muser_kv_main

    species = ZOO[name]
    path = write_local_model(tmp_path / name, model_type=species.module, quantize=species.quantize,
                             config_extra=dict(species.config, max_position_embeddings=MAX_CONTEXT),
                             **species.args)
    argv = ["--model", str(path), "--prompt", " ".join(f"t{i}" for i in range(4, 5 + 2 * WINDOW)),
            "--max-tokens", str(STEPS), "--temp", "0", "--ignore-chat-template"]
    monkeypatch.setattr("sys.argv", ["mlx_lm.generate", *argv])
    importlib.import_module("mlx_lm.generate").main()
    theirs = capsys.readouterr().out
    session = tmp_path / "s.safetensors"
    assert muser_kv_main(["generate", *argv, "--session", str(session)]) == 0
    mine = capsys.readouterr().out

    def text(out: str) -> str:  # the generated text, without the timing lines
        return out.split("==========")[1]

    assert text(mine) == text(theirs)
    snapshot = muser_kv.read_session(session)
    assert snapshot.position > 2 * WINDOW and snapshot.geometry.max_context == MAX_CONTEXT


def test_every_mlx_lm_module_with_a_rotating_cache_is_in_the_models_table():
    """docs/models.md says, for every model module of the installed mlx-lm that
    creates a RotatingKVCache, whether it is served or why it is refused."""
    import pathlib

    import mlx_lm.models

    root = pathlib.Path(mlx_lm.models.__file__).parent
    modules = sorted(p.stem for p in root.glob("*.py")
                     if p.stem != "cache" and "RotatingKVCache(" in p.read_text())
    table = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    missing = [m for m in modules if f"`{m}`" not in table]
    assert not missing, f"docs/models.md does not say what muser-kv does with {missing}"
    for name in ZOO:  # every zoo model is a served row
        assert f"`{ZOO[name].module}` | served" in table or f"`{ZOO[name].module}` | plan read" in table
    for name in REFUSED:  # and every model the zoo shows refused, a refused one
        assert f"`{REFUSED[name][0].module}` | refused" in table


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One ``muser-kv serve`` per zoo model (bf16 checkpoints on disk, a prompt
    cache, ``--retain 6``), started together, stopped in any case."""
    import metal_plugin
    from local_model import write_local_model
    from servers import Server

    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the servers run the command itself, which does not install the tests' "
                    "Metal emulator")
    root = tmp_path_factory.mktemp("served")
    started = {}
    try:
        for name in RUNNABLE:
            species = ZOO[name]
            path = write_local_model(root / name, model_type=species.module,
                                     quantize=species.quantize,
                                     config_extra=dict(species.config,
                                                       max_position_embeddings=MAX_CONTEXT),
                                     **species.args)
            started[name] = (Server(path, root / f"{name}.log", "--retain", "6",
                                    mlx_lm_standins=True), path)
        for server, _ in started.values():
            server.wait_ready()
        yield started
    finally:
        for server, _ in started.values():
            server.stop()


@pytest.mark.parametrize("name", RUNNABLE)
def test_serve_answers_a_returning_chat_exactly(served, name):
    """A conversation past the wrap comes back with the answer less its last 3
    tokens (a client that renders the end of turn its own way): the stored
    entry is trimmed by 3, exactly, and the answer is the one muser-kv's caches
    give for the whole prompt in this process, prefilled at once: a token's
    attention on the CPU is the same bits however its request was chunked."""
    from servers import words

    server, path = served[name]

    eos = 127  # the local tokenizer's </s>: kept out, so every answer is 10 tokens

    def complete(prompt, n=10):
        out = server.post("/v1/completions", {"prompt": words(prompt), "max_tokens": n,
                                              "temperature": 0, "logprobs": True,
                                              "logit_bias": {str(eos): -1000}})
        got = [t["id"] for t in out["choices"][0]["logprobs"]["content"]]
        return got, out["usage"].get("prompt_tokens_details", {}).get("cached_tokens")

    first = PROMPT + PROMPT[:7]  # 20 tokens: every ring wrapped
    answer, cached = complete(first)
    assert cached == 0
    second = first + answer[:7] + [3, 5, 7, 11]
    got, cached = complete(second)
    assert len(answer) == 10, answer
    assert cached == len(first) + 7  # the stored turn (prompt + answer), trimmed by 3
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors

    model, _ = mlx_lm.load(str(path))
    bias = make_logits_processors(logit_bias={eos: -1000})
    want = greedy(model, muser_kv.make_prompt_cache(model), second, 10, logits_processors=bias)
    assert got == [t for t, _ in want]


def test_a_handoff_between_processes_is_exact_for_every_family(tmp_path):
    """Rank 0 prefills each family's session past the wrap and hands it over
    MLX's ring backend; rank 1 decodes from what it received: the logits of
    one process that did it all, bit for bit."""
    if not mx.distributed.is_available("ring"):
        pytest.skip("MLX's ring backend is not available")

    from handoff_child import ZOO_CONTEXT, ZOO_NEXT, ZOO_PROMPT, decode, zoo_names
    from ring_pair import RingPair

    if os.environ.get(EMULATOR_ENV):
        pytest.skip("the emulated-Metal run cannot route mlx.launch's children through the emulator")
    import json
    import pathlib

    child = pathlib.Path(__file__).resolve().parents[1] / "handoff_child.py"
    with RingPair(child, ["zoo", str(tmp_path)], tmp_path) as pair:
        codes = pair.wait(240)
        logs = pair.logs()
    assert None not in codes, logs
    sent, got = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for name in zoo_names():
        assert sent[name].get("ok") == len(ZOO_PROMPT) == got[name].get("ok"), (name, logs)
        m = tiny(name, mx.bfloat16)
        cache = muser_kv.make_prompt_cache(m, ZOO_CONTEXT)
        m(mx.array([ZOO_PROMPT]), cache=cache)
        alone = decode(m, cache, ZOO_NEXT)
        there = np.load(tmp_path / f"zoo-{name}.npy")
        assert np.array_equal(there.view(np.uint32), alone.view(np.uint32)), name
