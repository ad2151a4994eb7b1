"""Child process of the replay gate: restore each saved session into a fresh
cache of a freshly built (same seed) model and record its continuation."""

import ast
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from conftest import tiny_model
from helpers import restored_logits


def main(argv):
    folder, kw, n = Path(argv[0]), ast.literal_eval(argv[1]), int(argv[2])
    model = tiny_model(mx.float32, **kw)
    prompt = np.load(folder / "prompt.npy")
    for g in map(int, argv[3:]):
        got = restored_logits(model, folder / f"session_{g}.safetensors", prompt[g:g + n].tolist())
        np.save(folder / f"restored_{g}.npy", got)


if __name__ == "__main__":
    main(sys.argv[1:])
