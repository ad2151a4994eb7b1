"""Geometry and footprint: the footprint formula's figures for Muse Glimmer, to the byte."""

import pytest

from muser_kv import LayerKind, MuseGeometry, footprint
from muser_kv.serving.cli import main as cli_main


def test_defaults_are_muse_glimmer():
    g = MuseGeometry()
    assert (g.num_layers, g.window, g.max_context) == (52, 2048, 131072)
    assert (g.num_heads, g.kv_heads, g.head_dim) == (32, 2, 128)
    assert g.kv_dim == 256 and g.row_bytes == 1024
    assert [i for i in range(52) if g.layer_kind(i) is LayerKind.GLOBAL] == list(range(3, 52, 4))
    assert (g.sliding_layers, g.global_layers) == (39, 13)


def test_table_22_1_to_the_byte():
    g = MuseGeometry()
    one = footprint(g, 131072)
    assert one.swa_bytes == 81_788_928
    assert one.nope_bytes == 1_744_830_464
    assert one.slot_bytes == 1_826_619_392
    assert footprint(g, 131072, slots=4).total_bytes == 7_306_477_568
    assert one.per_token_below_window == 53_248
    assert one.per_token_above_window == 13_312
    assert footprint(g, 8192, 4).total_bytes == 763_363_328
    assert footprint(g, 32768, 4).total_bytes == 2_071_986_176
    # Two routes, one number: below the window both formulas coincide.
    assert footprint(g, 2048).slot_bytes == 52 * 2048 * 1024 == 109_051_904
    assert one.slot_bytes / footprint(g, 2048).slot_bytes == 16.75


def test_footprint_matches_allocated_rows():
    g = MuseGeometry(num_layers=10, window=64, max_context=1000)
    fp = footprint(g, 1000)
    assert [g.capacity(i) for i in range(4)] == [64, 64, 64, 1000]
    assert [g.allocated(i) for i in range(4)] == [256, 256, 256, 1024]
    assert fp.slot_bytes == sum(g.allocated(i) for i in range(10)) * g.row_bytes
    assert fp.formula_bytes == sum(g.capacity(i) for i in range(10)) * g.row_bytes
    # at row counts that are already multiples of 256 the two agree
    assert footprint(MuseGeometry(), 131072).formula_bytes == footprint(MuseGeometry(), 131072).slot_bytes


def test_from_model_args_reads_layer_types_and_window():
    from mlx_lm.models.muse_glimmer import ModelArgs

    args = ModelArgs(hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=128, sliding_window=16,
                     max_position_embeddings=512)
    g = MuseGeometry.from_model_args(args)
    assert (g.num_layers, g.window, g.max_context, g.kv_heads, g.head_dim) == (8, 16, 512, 2, 128)
    assert [k.value for k in g.layer_kinds] == args.layer_types
    assert MuseGeometry.from_model_args(args, max_context=100).max_context == 100
    with pytest.raises(ValueError, match="exceeds"):
        MuseGeometry.from_model_args(args, max_context=513)
    custom = ModelArgs(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=128,
                       layer_types=["full_attention", "sliding_attention", "full_attention"])
    assert MuseGeometry.from_model_args(custom).layer_kinds == (
        LayerKind.GLOBAL, LayerKind.SLIDING, LayerKind.GLOBAL)


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(window=-1), dict(kv_heads=3),
                                 dict(num_layers=4, layer_kinds=("full_attention",))])
def test_bad_geometry_refused(bad):
    with pytest.raises(ValueError):
        MuseGeometry(**bad)


def test_cli_footprint_prints_table(capsys):
    assert cli_main(["footprint", "--context", "131072", "--slots", "4"]) == 0
    out = capsys.readouterr().out
    for figure in ("1,826,619,392 B", "7,306,477,568 B", "81,788,928 B", "1,744,830,464 B",
                   "53,248 B", "13,312 B", "16.75x"):
        assert figure in out


def test_cli_any_context_and_plot(tmp_path, capsys):
    png = tmp_path / "fp.png"
    assert cli_main(["footprint", "--context", "5000", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    expected = footprint(MuseGeometry(), 5000).slot_bytes
    assert f"{expected:,} B" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_footprint_off_the_granule_shows_allocated_and_formula(capsys):
    assert cli_main(["footprint", "--context", "100000", "--plane-dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    g = MuseGeometry()
    fp = footprint(g, 100000)
    assert fp.slot_bytes == (39 * 2048 + 13 * 100096) * 1024 == 1_414_266_880
    assert fp.formula_bytes == (39 * 2048 + 13 * 100000) * 1024 == 1_412_988_928
    assert "one slot:               1,414,266,880 B" in out
    assert "one slot by the formula (rows not rounded): 1,412,988,928 B" in out
    assert "global planes 100,096 for 100,000" in out and "bfloat16 planes" in out


# -- issue #10, item 9: a model muser-kv does not serve says why --------------------


def _llama(**kw):
    from mlx_lm.models import llama

    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=64)
    base.update(kw)
    return llama.Model(llama.ModelArgs(**base))


def test_a_model_without_sliding_layers_is_named_clearly():
    """make_prompt_cache(llama) failed with int(None) deep inside; it must say
    what the model lacks and what kind of model muser-kv serves."""
    import muser_kv

    with pytest.raises(muser_kv.UnsupportedModel) as e:
        muser_kv.make_prompt_cache(_llama())
    text = str(e.value)
    assert "model_type 'llama'" in text and "has no sliding-window layers" in text
    assert "its make_cache() builds 2 KVCache" in text
    assert "sliding-window and global attention layers" in text
    assert isinstance(e.value, TypeError)  # what a model of the wrong kind has always raised
    # the plan is read, the context is not guessed: with none named, the list has
    # no preset bound (rings of the window, growing global planes), and only
    # preallocated planes, which need one, ask for it
    no_context = _llama(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    no_context.args.max_position_embeddings = None
    unbounded = muser_kv.make_prompt_cache(no_context)
    assert [c.max_context for c in unbounded] == [muser_kv.UNBOUNDED_CONTEXT] * 2
    assert [c.capacity for c in unbounded] == [16, muser_kv.UNBOUNDED_CONTEXT]
    assert not muser_kv.MuseGeometry.from_model(no_context).bounded
    with pytest.raises(muser_kv.UnsupportedModel, match=r"carry no max_position_embeddings: "
                                                         r"pass max_context"):
        muser_kv.make_prompt_cache(no_context, preallocate=True)
    assert len(muser_kv.make_prompt_cache(no_context, max_context=64)) == 2
    assert len(muser_kv.make_prompt_cache(no_context, max_context=64, preallocate=True)) == 2


def test_a_layer_type_muser_kv_does_not_serve_is_named():
    import muser_kv

    model = _llama(max_position_embeddings=128, sliding_window=16,
                   layer_types=["full_attention", "linear_attention"])
    with pytest.raises(muser_kv.UnsupportedModel,
                       match=r"layer_types has \['linear_attention'\]; muser-kv serves "
                             r"sliding-window and global attention layers only"):
        muser_kv.make_prompt_cache(model)
    with pytest.raises(muser_kv.UnsupportedModel, match=r"needs an mlx-lm model with \.args"):
        muser_kv.make_prompt_cache(object())
    with pytest.raises(muser_kv.UnsupportedModel, match=r"layer 0's RotatingKVCache has max_size "
                                                         r"16.5, expected a positive int"):
        muser_kv.make_prompt_cache(_llama(max_position_embeddings=128, sliding_window=16.5,
                                          layer_types=["sliding_attention", "full_attention"]))


def test_a_model_with_the_fields_is_served_whatever_its_family():
    import muser_kv

    model = _llama(max_position_embeddings=128, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"])
    cache = muser_kv.make_prompt_cache(model)
    assert [c.kind.value for c in cache] == ["sliding_attention", "full_attention"]


def _gemma3(**kw):
    """A tiny Gemma 3 text model: its args carry ``sliding_window_pattern``, not
    ``layer_types``; its own ``make_cache()`` puts a global layer every third."""
    from mlx_lm.models import gemma3_text

    base = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6,
                intermediate_size=128, num_attention_heads=4, head_dim=32,
                num_key_value_heads=2, vocab_size=64, sliding_window=8,
                sliding_window_pattern=3, rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_local_base_freq=10000.0, query_pre_attn_scalar=32.0)
    base.update(kw)
    return gemma3_text.Model(gemma3_text.ModelArgs(**base))


def test_the_plan_is_read_from_the_models_own_caches_never_guessed():
    """Gemma 3 has no layer_types; Muse Glimmer's i % 4 == 3 was once assumed, its
    global layers landed in the wrong places and the first token was wrong. The
    plan now comes from the model's own make_cache(), layer for layer, whatever
    its args say; args alone (no model) without layer_types are still refused."""
    import muser_kv

    model = _gemma3()
    cache = muser_kv.make_prompt_cache(model)
    own = type(model).make_cache(model)
    assert [type(c).__name__ for c in own] == ["RotatingKVCache", "RotatingKVCache", "KVCache"] * 2
    assert [c.kind for c in cache] == [LayerKind.SLIDING, LayerKind.SLIDING, LayerKind.GLOBAL] * 2
    assert [c.window for c in cache] == [8, 8, None] * 2 and {c.max_context for c in cache} == {32768}
    # a wrong layer_types field does not move a layer: the model's code decides
    model.args.layer_types = ["sliding_attention"] * 3 + ["full_attention"] + \
        ["sliding_attention"] * 2
    assert [c.kind for c in muser_kv.make_prompt_cache(model, 64)] == [c.kind for c in cache]
    del model.args.layer_types
    with pytest.raises(muser_kv.UnsupportedModel, match=r"model_type 'gemma3_text'.*has no "
                       r"layer_types.*will not guess a layer plan"):
        MuseGeometry.from_model_args(model.args)


def test_caches_muser_kv_cannot_serve_exactly_are_named():
    from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache

    import muser_kv

    muse = tiny_muse()

    class TwoWindows(type(muse)):
        def make_cache(self):
            caches = super().make_cache()
            caches[0] = RotatingKVCache(max_size=self.args.sliding_window * 2)
            return caches

    with pytest.raises(muser_kv.UnsupportedModel, match=r"sliding layers of windows \[16, 32\]; "
                                                         r"muser-kv serves one window per model"):
        muser_kv.make_prompt_cache(TwoWindows(muse.args))

    class Chunked(type(muse)):
        def make_cache(self):
            caches = super().make_cache()
            caches[1] = ChunkedKVCache(8)
            return caches

    with pytest.raises(muser_kv.UnsupportedModel, match=r"layer 1's own cache is a "
                       r"mlx_lm.models.cache.ChunkedKVCache.*\(this one is chunked attention\)"):
        muser_kv.make_prompt_cache(Chunked(muse.args))

    class Sinks(type(muse)):
        def make_cache(self):
            caches = super().make_cache()
            caches[0] = RotatingKVCache(max_size=self.args.sliding_window, keep=4)
            return caches

    with pytest.raises(muser_kv.UnsupportedModel, match=r"keeps 4 attention-sink rows"):
        muser_kv.make_prompt_cache(Sinks(muse.args))
    # the model itself is served, one cache per entry of its own list
    assert len(muser_kv.make_prompt_cache(muse)) == 8


def tiny_muse():
    from conftest import tiny_model

    return tiny_model()
