"""A tiny random-weight model on disk, in the layout ``mlx_lm.load`` reads, so
mlx-lm's own commands (generate, chat, server) run on this machine with no hub.

``write_local_model(directory, **args)`` writes ``config.json``,
``model.safetensors`` (mlx-lm's ``save_model``) and the word-level tokenizer of
``local_tokenizer`` (ids ``t0`` .. ``t{vocab-2}``, ``</s>`` last), with a chat
template, and returns ``directory``. The default is Muse Glimmer with the tests'
tiny geometry (``conftest.tiny_args``: hidden 64, 8 layers, 2 KV heads x 128,
window 16, max_position_embeddings 256); ``model_type="llama"`` writes a tiny
Llama instead (a model muser-kv does not serve). Weights are seeded: the same
arguments write the same files.

``local_muse_model`` (conftest.py) is the session-scoped fixture of the default
model (bf16 weights).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, Dict, Union

import mlx.core as mx
import mlx.nn as nn
from local_tokenizer import save_tokenizer
from mlx_lm.utils import save_config, save_model

#: The chat template both mlx-lm commands apply: every message's content, then
#: ``t1`` as the generation prompt (all words the local tokenizer knows).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t1{% endif %}")

DEFAULTS: Dict[str, Dict[str, Any]] = {
    "muse_glimmer": dict(hidden_size=64, num_hidden_layers=8, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                         vocab_size=256, sliding_window=16, max_position_embeddings=256),
    "llama": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  vocab_size=256, max_position_embeddings=256, tie_word_embeddings=True),
}


def write_local_model(directory: Path, *, model_type: str = "muse_glimmer",
                      dtype: str = "bfloat16", seed: int = 0, quantize: Union[bool, str] = False,
                      config_extra: Dict[str, Any] | None = None, **args: Any) -> Path:
    """Write a random-weight ``model_type`` checkpoint (weights in ``dtype``;
    8-bit quantized where ``quantize``: every layer that can be, or where it is a
    string only the modules whose path holds it; ``config_extra`` added to its
    config.json) with the local tokenizer into ``directory`` (created if
    missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    fields = dict(DEFAULTS.get(model_type, {}), **args)
    model_args = module.ModelArgs(model_type=model_type, **fields)
    mx.random.seed(seed)
    model = module.Model(model_args)
    model.set_dtype(getattr(mx, dtype))
    quantization = dict(group_size=32, bits=8)
    if quantize:
        only = quantize if isinstance(quantize, str) else ""
        nn.quantize(model, **quantization,
                    class_predicate=lambda path, m: hasattr(m, "to_quantized") and only in path)
    mx.eval(model.parameters())
    save_model(directory, model)
    # args left at a None default stay out, as from a real checkpoint (transformers
    # validates Muse Spark's: out_hidden_size must be an int where present)
    config = {k: v for k, v in dataclasses.asdict(model_args).items() if v is not None or k in fields}
    config["torch_dtype"] = dtype
    if quantize:
        config["quantization"] = quantization
    config.update(config_extra or {})
    save_config(config, directory / "config.json")
    # a multimodal model's args (Muse Spark's) keep the language model's in text_config
    vocab_size = fields["vocab_size"] if "vocab_size" in fields else fields["text_config"]["vocab_size"]
    save_tokenizer(vocab_size, directory)
    tokenizer_config = directory / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["chat_template"] = CHAT_TEMPLATE
    tokenizer_config.write_text(json.dumps(settings, indent=2))
    return directory
