"""Tiny random-weight models of every sliding-window family muser-kv serves,
built from each mlx-lm module's own ``ModelArgs`` (no hub, no download).

``ZOO`` maps a name to the module and the tiny arguments; ``REFUSED`` holds
the modules muser-kv refuses, each with the reason it must name;
``tiny(name, dtype)`` builds either. Windows are small (8) so a few dozen tokens wrap every ring;
``MAX_CONTEXT`` is what the tests preallocate (several of these configs carry
no ``max_position_embeddings``: the real checkpoints' config.json has it, but
mlx-lm's ``ModelArgs`` drops it). Muse Spark's forward calls mlx-lm's fused
Metal kernels: off Apple silicon it runs on ``mlx_lm_kernels``' stand-ins,
which conftest patches in for every test.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

WINDOW = 8
MAX_CONTEXT = 96

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=128)

#: Step 3.5 names its K/V heads num_attention_groups
_STEP_COMMON = {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}


@dataclass(frozen=True)
class Species:
    module: str
    args: Dict[str, Any] = field(default_factory=dict)
    #: 8-bit experts, as mlx-community ships these MoE models: MLX's CPU
    #: gather_mm runs f32 only, its quantized gather runs f16 and bf16. True
    #: quantizes every layer that can be; a string only the modules whose path
    #: holds it (``quantizes``)
    quantize: Union[bool, str] = False
    #: what the checkpoint's config.json carries beside the args (transformers
    #: reads it too, where the tokenizer is loaded)
    config: Dict[str, Any] = field(default_factory=dict)
    #: the weight dtypes the conformance suite runs it in
    dtypes: Tuple[str, ...] = ("f16", "bf16")


ZOO: Dict[str, Species] = {
    "muse_glimmer": Species("muse_glimmer", dict(_COMMON, num_hidden_layers=8, head_dim=32,
                                                 sliding_window=WINDOW,
                                                 max_position_embeddings=MAX_CONTEXT)),
    "cohere2": Species("cohere2", dict(_COMMON, num_hidden_layers=8, head_dim=16,
                                       sliding_window=WINDOW, sliding_window_pattern=4)),
    "exaone4": Species("exaone4", dict(_COMMON, num_hidden_layers=8, head_dim=32,
                                       rms_norm_eps=1e-5, max_position_embeddings=MAX_CONTEXT,
                                       rope_theta=10000.0, tie_word_embeddings=True,
                                       rope_scaling=None, sliding_window=WINDOW,
                                       sliding_window_pattern="LLLG"),
                       config=dict(layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2)),
    "gemma3_text": Species("gemma3_text", dict(_COMMON, num_hidden_layers=6, head_dim=32,
                                               sliding_window=WINDOW, sliding_window_pattern=3,
                                               query_pre_attn_scalar=32,
                                               max_position_embeddings=MAX_CONTEXT)),
    "gemma4_text": Species("gemma4_text", dict(_COMMON, num_hidden_layers=8, head_dim=32,
                                               global_head_dim=64, num_kv_shared_layers=3,
                                               hidden_size_per_layer_input=16,
                                               vocab_size_per_layer_input=128,
                                               sliding_window=WINDOW, sliding_window_pattern=4,
                                               max_position_embeddings=MAX_CONTEXT)),
    "gpt_oss": Species("gpt_oss", dict(_COMMON, num_hidden_layers=4, head_dim=32,
                                       num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=WINDOW,
                                       layer_types=["sliding_attention", "full_attention"] * 2),
                       quantize=True),
    "muse_spark": Species("muse_spark", dict(text_config=dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_hidden_layers=8, vocab_size=128, rms_norm_eps=1e-5, post_norm_eps=1e-8,
        rope_parameters={"rope_theta": 10000.0},
        layer_rope_theta=[10000.0, 10000.0, 10000.0, 0.0] * 2,
        layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
        + ["full_attention"],
        sliding_window=WINDOW, final_logit_softcapping=20.0, output_multiplier=0.2,
        num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=32,
        moe_intermediate_size=64)),
        # its experts only, as its own quant_predicate (which keeps the first and last layers'
        # experts whole: unquantized they would need MLX's f32-only CPU gather_mm); a quantized
        # lm_head would break its forward, which casts the hidden state to lm_head.weight.dtype
        quantize=".mlp.experts.",
        # a bf16 model: its forward casts the attention input to bf16, so f16 weights would
        # compute attention in f32, whose rows mlx-lm's caches keep and muser-kv's f16 planes
        # round (test_an_f16_muse_spark_attends_in_f32)
        dtypes=("bf16",),
        # transformers' MuseSparkConfig (read where the tokenizer loads) checks that its default
        # audio tower projects onto the text model's width
        config=dict(audio_config=dict(out_hidden_size=64))),
    "olmo3": Species("olmo3", dict(_COMMON, num_hidden_layers=8, head_dim=32, rms_norm_eps=1e-6,
                                   max_position_embeddings=MAX_CONTEXT, sliding_window=WINDOW,
                                   rope_theta=10000.0)),
    # the modules below share the same RotatingKVCache / KVCache plans (docs/models.md)
    "afmoe": Species("afmoe", dict(_COMMON, num_hidden_layers=4, head_dim=16,
                                   max_position_embeddings=MAX_CONTEXT, sliding_window=WINDOW,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   num_dense_layers=1), quantize=True),
    "exaone_moe": Species("exaone_moe", dict(_COMMON, num_hidden_layers=4, head_dim=16,
                                             moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, num_shared_experts=1,
                                             rms_norm_eps=1e-5, max_position_embeddings=MAX_CONTEXT,
                                             sliding_window=WINDOW,
                                             layer_types=["sliding_attention"] * 3
                                             + ["full_attention"],
                                             is_moe_layer=[False, True, True, True]),
                          quantize=True),
    "laguna": Species("laguna", dict(_COMMON, num_hidden_layers=4, head_dim=16,
                                     max_position_embeddings=MAX_CONTEXT, sliding_window=WINDOW,
                                     layer_types=["full_attention"] + ["sliding_attention"] * 3,
                                     num_attention_heads_per_layer=[4, 8, 8, 8],
                                     rope_parameters={
                                         "full_attention": {"rope_theta": 1000000.0,
                                                            "partial_rotary_factor": 0.5},
                                         "sliding_attention": {"rope_theta": 10000.0}},
                                     num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32, shared_expert_intermediate_size=32),
                      quantize=True),
    "mellum": Species("mellum", dict(_COMMON, num_hidden_layers=4, head_dim=16,
                                     rms_norm_eps=1e-6, tie_word_embeddings=False,
                                     max_position_embeddings=MAX_CONTEXT, sliding_window=WINDOW,
                                     layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                     rope_parameters={"full_attention": {"rope_theta": 1e6},
                                                      "sliding_attention": {"rope_theta": 1e4}},
                                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                     norm_topk_prob=True), quantize=True),
    "ministral3": Species("ministral3", dict(_COMMON, num_hidden_layers=4, head_dim=16,
                                             rms_norm_eps=1e-5, max_position_embeddings=MAX_CONTEXT,
                                             sliding_window=WINDOW,
                                             layer_types=["sliding_attention"] * 3
                                             + ["full_attention"],
                                             # positions past 16 scale the queries (llama 4's
                                             # attention scaling): the tests reach them
                                             rope_parameters={"rope_type": "default",
                                                              "rope_theta": 1e6,
                                                              "llama_4_scaling_beta": 0.1,
                                                              "original_max_position_embeddings": 16})),
    "spark2_5": Species("spark2_5", dict(_COMMON, num_hidden_layers=4, head_dim=16,
                                         max_position_embeddings=MAX_CONTEXT, sliding_window=WINDOW,
                                         rope_parameters={
                                             "full_attention": {"rope_theta": 1e6,
                                                                "partial_rotary_factor": 0.5},
                                             "sliding_attention": {"rope_theta": 1e4}})),
    "step3p5": Species("step3p5", dict(_STEP_COMMON, num_hidden_layers=4, head_dim=16,
                                       num_attention_groups=2, max_position_embeddings=MAX_CONTEXT,
                                       sliding_window=WINDOW,
                                       layer_types=["full_attention"] + ["sliding_attention"] * 3,
                                       # the sliding layers' own heads: other K/V heads per kind
                                       attention_other_setting={"num_attention_heads": 8,
                                                                "num_attention_groups": 4},
                                       moe_num_experts=4, moe_top_k=2, moe_intermediate_size=32,
                                       share_expert_dim=32, moe_layers_enum="2,3",
                                       swiglu_limits=[0, 0, 7.0, 7.0]), quantize=True),
}


#: Modules whose plan is read by the same reader but that muser-kv cannot serve
#: exactly: each tiny config keeps the real checkpoints' trait, and the
#: ``UnsupportedModel`` message it must raise (a regex) names why.
REFUSED: Dict[str, Tuple[Species, str]] = {
    # its last layers read earlier layers' caches (cache.keys_and_values())
    "gemma3n": (Species("gemma3n", dict(text_config=dict(
        model_type="gemma3n_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=4, head_dim=16, rms_norm_eps=1e-6, vocab_size=128,
        num_key_value_heads=2, num_kv_shared_layers=2, vocab_size_per_layer_input=128,
        sliding_window=WINDOW, max_position_embeddings=MAX_CONTEXT, rope_local_base_freq=10000.0,
        rope_theta=1e6, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.95, 0.95] + [0.0] * 4, hidden_size_per_layer_input=16,
        altup_num_inputs=4, altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0,
        laurel_rank=8))),
        r"another layer reads layer 2's cache through keys_and_values\(\)"),
    # keys of head_dim 192 and values of 128 in the real checkpoints: 24 and 16 here
    "mimo_v2_flash": (Species("mimo_v2_flash", dict(
        num_experts_per_tok=2, hybrid_layer_pattern=[0, 1, 1, 1], moe_layer_freq=[0, 1, 1, 1],
        add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
        sliding_window_size=WINDOW, vocab_size=128, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, n_shared_experts=None, n_routed_experts=4,
        routed_scaling_factor=None, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, max_position_embeddings=MAX_CONTEXT,
        layernorm_epsilon=1e-5, rope_theta=5e6, swa_rope_theta=10000.0, swa_num_attention_heads=8,
        swa_num_key_value_heads=4, head_dim=24, v_head_dim=16, swa_head_dim=24, swa_v_head_dim=16,
        partial_rotary_factor=1 / 3), quantize=True),
        r"layer 0 hands its cache keys \(1, 2, 1, 24\) and values \(1, 2, 1, 16\)"),
    # its sliding layers mask window_size + 1 rows over a RotatingKVCache(window_size)
    "plamo3": (Species("plamo3", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=MAX_CONTEXT, window_size=WINDOW,
        sliding_window_pattern=4, intermediate_size=128, vocab_size=128)),
        rf"masks layer 0 to a window of {WINDOW + 1} rows, but its own make_cache\(\) gives "
        rf"that layer a RotatingKVCache of {WINDOW}"),
}


def quantizes(quantize: Union[bool, str]) -> Callable[[str, Any], bool]:
    """``nn.quantize``'s class predicate for a ``Species.quantize``."""
    only = quantize if isinstance(quantize, str) else ""
    return lambda path, m: hasattr(m, "to_quantized") and only in path


def tiny(name: str, dtype: Any = mx.float16, seed: int = 0, context: Optional[int] = None) -> Any:
    """The tiny ``name`` model (``ZOO`` or ``REFUSED``) in ``dtype``, weights seeded;
    ``context`` replaces ``MAX_CONTEXT`` where the args carry a context length."""
    species = ZOO[name] if name in ZOO else REFUSED[name][0]
    module = importlib.import_module(f"mlx_lm.models.{species.module}")
    fields = dict(species.args)
    if context is not None and "max_position_embeddings" in fields:
        fields["max_position_embeddings"] = context
    args = module.ModelArgs(model_type=species.module, **fields)
    mx.random.seed(seed)
    model = module.Model(args)
    model.set_dtype(dtype)
    if species.quantize:
        nn.quantize(model, group_size=32, bits=8, class_predicate=quantizes(species.quantize))
    mx.eval(model.parameters())
    return model
