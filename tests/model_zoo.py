"""Tiny random-weight models of every sliding-window family muser-kv serves,
built from each mlx-lm module's own ``ModelArgs`` (no hub, no download).

``ZOO`` maps a name to the module and the tiny arguments; ``tiny(name, dtype)``
builds the model. Windows are small (8) so a few dozen tokens wrap every ring;
``MAX_CONTEXT`` is what the tests preallocate (several of these configs carry
no ``max_position_embeddings``: the real checkpoints' config.json has it, but
mlx-lm's ``ModelArgs`` drops it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn

WINDOW = 8
MAX_CONTEXT = 96

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=128)


@dataclass(frozen=True)
class Species:
    module: str
    args: Dict[str, Any] = field(default_factory=dict)
    #: 8-bit experts, as mlx-community ships these MoE models: MLX's CPU
    #: gather_mm runs f32 only, its quantized gather runs f16 and bf16
    quantize: bool = False
    #: what the checkpoint's config.json carries beside the args (transformers
    #: reads it too, where the tokenizer is loaded)
    config: Dict[str, Any] = field(default_factory=dict)


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
        moe_intermediate_size=64)), quantize=True),
    "olmo3": Species("olmo3", dict(_COMMON, num_hidden_layers=8, head_dim=32, rms_norm_eps=1e-6,
                                   max_position_embeddings=MAX_CONTEXT, sliding_window=WINDOW,
                                   rope_theta=10000.0)),
}


def tiny(name: str, dtype: Any = mx.float16, seed: int = 0) -> Any:
    """The tiny ``name`` model in ``dtype``, weights seeded."""
    species = ZOO[name]
    module = importlib.import_module(f"mlx_lm.models.{species.module}")
    args = module.ModelArgs(model_type=species.module, **species.args)
    mx.random.seed(seed)
    model = module.Model(args)
    model.set_dtype(dtype)
    if species.quantize:
        nn.quantize(model, group_size=32, bits=8,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized"))
    mx.eval(model.parameters())
    return model
