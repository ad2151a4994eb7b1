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

import ctypes
import io
import json
import math
import os
import reprlib
import struct
import sys
from dataclasses import dataclass
from typing import BinaryIO, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

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


#: Bytes per read or write call: large enough that a call's overhead vanishes,
#: small enough that reading overlaps whatever consumes the bytes.
CHUNK = 16 << 20
#: Threads that read, write or hash a file's tensors side by side (None: one per
#: core, at most 8).
WORKERS: Optional[int] = None


def workers() -> int:
    """The threads a session's reads, writes and digests run on (``WORKERS``)."""
    return WORKERS or max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class Entry:
    """One tensor of a file's table: its dtype name, shape and absolute byte range."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def head(tensors: Sequence[Tuple[str, str, Sequence[int]]], metadata: Mapping[str, str]) -> bytes:
    """The bytes before the data of a file holding ``tensors`` (``(name, dtype,
    shape)``, in order, back to back) with ``metadata``: the u64 length and the
    JSON header, padded with spaces to 8 bytes."""
    table: Dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * STORAGE[dtype].itemsize
        table[name] = {"dtype": dtype, "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _buffer(data: Union[bytes, memoryview, np.ndarray]) -> memoryview:
    """``data``'s buffer (an ndarray's is its ``.data``, the same memoryview:
    numpy's stubs declare the buffer protocol only from Python 3.12)."""
    return data.data if isinstance(data, np.ndarray) else memoryview(data)


def write_all(fd: int, data: Union[bytes, memoryview, np.ndarray],
              chunk: Optional[int] = None) -> None:
    """Every byte of ``data`` (C-contiguous) to ``fd`` at its offset, ``chunk``
    (default ``CHUNK``) at a time."""
    chunk = chunk or CHUNK
    view = _buffer(data)
    view = view.cast("B") if len(view) else memoryview(b"")
    while view:
        view = view[os.write(fd, view[:chunk]):]


def _sync_file_range() -> Optional[Callable[[int, int, int, int], int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``fd``'s bytes ``[offset, offset + nbytes)``
    to the device now (Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so
    the device works while the writer goes on and the final fsync has less to
    wait for. Best effort, and no durability promise: only fsync makes one."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def prefetch(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start reading ``fd``'s bytes ``[offset, offset + nbytes)``
    into the page cache now (``posix_fadvise(WILLNEED)``), so the device has the
    next read queued while this one is consumed. Best effort."""
    if hasattr(os, "posix_fadvise") and nbytes > 0:
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


def _header(raw: bytes) -> dict:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise TensorFileError(f"header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"header expected a JSON object, got {type(header).__name__}")
    return header


def read_table(f: BinaryIO) -> Tuple[Dict[str, str], List[Entry]]:
    """``(metadata, entries)`` of the open file ``f`` (entries in the header's
    order), reading only its header: every entry's dtype, shape and byte span
    checked, the spans tiling the data exactly to the file's end; else
    ``TensorFileError`` naming what is wrong."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise TensorFileError(f"truncated: {size} bytes, no header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > min(MAX_HEADER, size - 8):
        raise TensorFileError(f"truncated or not safetensors: header length {n}, file {size} bytes")
    raw = f.read(n)
    if len(raw) != n:
        raise TensorFileError(f"truncated: header of {n} bytes, read {len(raw)}")
    header = _header(raw)
    data_len = size - 8 - n
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TensorFileError("__metadata__ expected a JSON object of strings")
    entries = []
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
        entries.append(Entry(name, dtype, tuple(shape), 8 + n + offsets[0], 8 + n + offsets[1]))
    end = 8 + n
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin != end:
            raise TensorFileError(f"tensor {show(e.name)}: data starts at byte {e.begin - 8 - n}, "
                                  f"expected {end - 8 - n} (tensors must tile the data)")
        end = e.end
    if end - 8 - n != data_len:
        raise TensorFileError(f"truncated: tensors need {end - 8 - n} data bytes, file has "
                              f"{data_len}")
    return metadata, entries


def read_into(f: Union[io.RawIOBase, io.BufferedIOBase], entry: Entry, out: Union[memoryview, np.ndarray],
              chunk: Optional[int] = None) -> None:
    """``entry``'s bytes into ``out`` (writable, C-contiguous, at least
    ``entry.nbytes``), ``chunk`` (default ``CHUNK``) at a time with ``readinto``;
    a file that ends early (it shrank since its table was read) is
    ``TensorFileError``."""
    chunk = chunk or CHUNK
    if not entry.nbytes:
        return
    view = _buffer(out).cast("B")[:entry.nbytes]
    f.seek(entry.begin)
    done = 0
    while done < entry.nbytes:
        got = f.readinto(view[done:done + chunk])
        if not got:
            raise TensorFileError(f"truncated: tensor {show(entry.name)} short by "
                                  f"{entry.nbytes - done} bytes")
        done += got


def read_at(fd: int, entry: Entry, out: Union[memoryview, np.ndarray],
            chunk: Optional[int] = None) -> None:
    """``entry``'s bytes into ``out`` (writable, C-contiguous, at least
    ``entry.nbytes``) with positional reads of ``chunk`` (default ``CHUNK``)
    bytes: they never move the descriptor's offset, so threads may read
    different entries of one open file at once (the file a header was verified
    from, never a second open that a rename could have swapped). A file that
    ends early is ``TensorFileError``."""
    chunk = chunk or CHUNK
    if not entry.nbytes:
        return
    view = _buffer(out).cast("B")[:entry.nbytes]
    done = 0
    while done < entry.nbytes:
        part = view[done:done + chunk]
        if _PREADV:
            got = os.preadv(fd, [part], entry.begin + done)
        else:  # no preadv (some platforms): read, then copy
            data = os.pread(fd, len(part), entry.begin + done)
            got = len(data)
            part[:got] = data
        if not got:
            raise TensorFileError(f"truncated: tensor {show(entry.name)} short by "
                                  f"{entry.nbytes - done} bytes")
        done += got


_PREADV = hasattr(os, "preadv")


def read(path: PathLike) -> Tuple[Dict[str, str], Dict[str, Tensor]]:
    """``(metadata, tensors)`` of a safetensors file, in the header's order, or
    ``TensorFileError`` naming what is wrong (``FileNotFoundError`` and other
    ``OSError`` pass through)."""
    with open(path, "rb", buffering=0) as f:
        metadata, entries = read_table(f)
        tensors: Dict[str, Tensor] = {}
        for e in sorted(entries, key=lambda e: e.begin):  # file order: one forward pass
            storage = STORAGE[e.dtype]
            data = np.empty(e.nbytes // storage.itemsize, storage)
            read_into(f, e, data)
            tensors[e.name] = Tensor(e.dtype, data.reshape(e.shape))
    return metadata, {e.name: tensors[e.name] for e in entries}
