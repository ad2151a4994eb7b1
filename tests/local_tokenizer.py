"""A small tokenizer built on this machine (no hub): one word-level token per
id, ``t0`` .. ``t{n-1}``, so any random-weight model's ids detokenize.

``tokenizer(vocab)`` gives mlx-lm's ``TokenizerWrapper`` around a
``transformers`` fast tokenizer; ``save_tokenizer(vocab, directory)`` writes the
files ``mlx_lm.load`` reads from a local model directory.
"""

from __future__ import annotations

from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS = "</s>"


def _fast(vocab: int) -> PreTrainedTokenizerFast:
    words = {f"t{i}": i for i in range(vocab - 1)}
    words[EOS] = vocab - 1
    core = Tokenizer(models.WordLevel(words, unk_token=EOS))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, unk_token=EOS)


def tokenizer(vocab: int = 256) -> TokenizerWrapper:
    return TokenizerWrapper(_fast(vocab))


def save_tokenizer(vocab: int, directory: Path) -> None:
    _fast(vocab).save_pretrained(str(directory))
