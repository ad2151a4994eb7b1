"""The safetensors layout, read and written with nothing but numpy.

A safetensors file is a u64 little-endian header length, a JSON header (each
tensor's dtype, shape and byte range, plus a ``__metadata__`` table of strings)
padded with spaces to 8 bytes, then every tensor's bytes back to back. Our
session files are plain safetensors (``safetensors.safe_open`` and ``mx.load``
read them); this module exists because numpy has no bfloat16, so the
``safetensors`` package's numpy reader cannot hand back a BF16 tensor, and a
session reader must turn every malformed file into one clear error rather than
whatever a parser raises.

BF16 tensors travel as their uint16 bit patterns; ``Tensor.dtype`` keeps the
file's own name for the type, so a U16 tensor is never mistaken for one.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import struct
from dataclasses import dataclass
from typing import Dict, Mapping, Tuple, Union

import numpy as np

PathLike = Union[str, "os.PathLike[str]"]

#: safetensors dtype name -> numpy storage dtype (little-endian), for the types sessions use.
STORAGE: Dict[str, np.dtype] = {
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F32": np.dtype("<f4"),
}
#: The names a reader reports (numpy's, and "bfloat16" for BF16).
DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
#: A header larger than this is not a session header (safetensors caps at 100 MB).
MAX_HEADER = 100_000_000


class TensorFileError(ValueError):
    """The file is not a well-formed safetensors file of the types we store."""


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60
_SHORT.maxlist = _SHORT.maxdict = 8


def show(value: object) -> str:
    """A short repr of a value read from a file: a few levels and items deep,
    whatever its nesting (a plain repr of a deeply nested value recurses)."""
    return _SHORT.repr(value)


@dataclass(frozen=True, eq=False)
class Tensor:
    """One tensor as stored: ``dtype`` is the file's name (F16, BF16, F32)."""

    dtype: str
    data: np.ndarray

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]


def write(path: PathLike, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> None:
    """Stream ``tensors`` (in order) to ``path`` in the safetensors layout, straight
    from their buffers: no second copy of the payload is built in memory."""
    table: Dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors.items():
        table[name] = {"dtype": t.dtype, "shape": list(t.data.shape),
                       "data_offsets": [offset, offset + t.data.nbytes]}
        offset += t.data.nbytes
    head = json.dumps(table, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t in tensors.values():
            if t.data.size:
                f.write(memoryview(np.ascontiguousarray(t.data)).cast("B"))


def _header(raw: bytes) -> dict:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise TensorFileError(f"header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"header expected a JSON object, got {type(header).__name__}")
    return header


def read(path: PathLike) -> Tuple[Dict[str, str], Dict[str, Tensor]]:
    """``(metadata, tensors)`` of a safetensors file, or ``TensorFileError`` naming
    what is wrong (``FileNotFoundError`` and other ``OSError`` pass through)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise TensorFileError(f"truncated: {size} bytes, no header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(MAX_HEADER, size - 8):
            raise TensorFileError(f"truncated or not safetensors: header length {n}, file {size} bytes")
        header = _header(f.read(n))
        data_len = size - 8 - n
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TensorFileError("__metadata__ expected a JSON object of strings")
        spans = []
        for name, entry in header.items():
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                raise TensorFileError(f"tensor {show(name)}: entry expected dtype, shape and "
                                      f"data_offsets, got {show(entry)}")
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype, str) or dtype not in STORAGE:
                raise TensorFileError(f"tensor {show(name)}: dtype expected one of {sorted(STORAGE)}, "
                                      f"got {show(dtype)}")
            if not (isinstance(shape, list) and all(
                    type(d) is int and d >= 0 for d in shape)):
                raise TensorFileError(f"tensor {show(name)}: shape expected a list of sizes, "
                                      f"got {show(shape)}")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                    type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
                raise TensorFileError(f"tensor {show(name)}: data_offsets expected [begin, end], "
                                      f"got {show(offsets)}")
            nbytes = math.prod(shape) * STORAGE[dtype].itemsize
            if offsets[1] - offsets[0] != nbytes:
                raise TensorFileError(f"tensor {show(name)}: {dtype} {shape} needs {nbytes} bytes, "
                                      f"data_offsets span {offsets[1] - offsets[0]}")
            spans.append((offsets[0], offsets[1], name, dtype, shape))
        spans.sort()
        end = 0
        for begin, stop, name, _, _ in spans:
            if begin != end:
                raise TensorFileError(f"tensor {show(name)}: data starts at byte {begin}, "
                                      f"expected {end} (tensors must tile the data)")
            end = stop
        if end != data_len:
            raise TensorFileError(f"truncated: tensors need {end} data bytes, file has {data_len}")
        tensors: Dict[str, Tensor] = {}
        for begin, stop, name, dtype, shape in spans:
            storage = STORAGE[dtype]
            f.seek(8 + n + begin)
            data = np.fromfile(f, dtype=storage, count=(stop - begin) // storage.itemsize)
            if data.nbytes != stop - begin:
                raise TensorFileError(f"truncated: tensor {show(name)} short by "
                                      f"{stop - begin - data.nbytes} bytes")
            tensors[name] = Tensor(dtype, data.reshape(shape))
    order = [name for name in header]  # the header's own order
    return metadata, {name: tensors[name] for name in order}
