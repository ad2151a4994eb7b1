"""What the KV store keeps, how it is named, and its bytes.

**Names.** A chunk is ``CHUNK`` (256) consecutive positions. Its name is a
prefix hash chain: ``K[0]`` is the *scope* (the model fingerprint, the layer
plan and the plane encoding: rows of one scope are never read into another),
and ``K[j + 1] = sha256(K[j] || tokens of chunk j)``, so ``K[c]`` names the
whole prefix ``tokens[:CHUNK * c]`` and nothing else. SHA-256, not a fast
non-cryptographic hash: two conversations whose names collide would read each
other's rows, and a chat server's users choose the tokens.

**Objects**, each under a key derived from a chain name (``object_key``):

* ``G`` (``Rows``): every global layer's rows of chunk ``c - 1`` (named ``K[c]``).
* ``S`` (``Rows``): every sliding layer's rows of chunk ``c - 1``, kept when a
  put saw all of them in the rings.
* ``P`` (``Point``): a put point ``n = CHUNK * c + r``: the tail tokens
  ``tokens[CHUNK * c:n]`` (part of its key), the global rows of the tail, and
  the sliding rows of the window ``[n - window, n)`` that no ``S`` covers.
* ``I`` (``Index``): the tail lengths ``r`` of the points stored at ``K[c]``
  (the only object that changes: a put adds its ``r``).

Rows are the planes' values, never converted, in the planes' dtype, in token
order, layer-major: one ``[layers, count, kv_dim]`` block per plane (K, V) for
all the layers of a ``kv_dim`` (``blocks_of``; the layers in list order within
their kind). Bytes: the JSON header, then each block's K then V words, every
array at a multiple of ``ALIGN`` bytes from the start (zero bytes pad the
header and each array), so that a payload read into one MLX buffer is decoded
into views of it: no copy between the tier's read and the rebuild's join.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from muser_kv.core.geometry import LayerKind, MuseGeometry
from muser_kv.sessions import managed

#: Positions per chunk.
CHUNK = 256
#: The version of the object format below (part of every scope, so objects of
#: another version are never looked up). 3: rows layer-major, one block per
#: kv_dim, each array ``ALIGN``-aligned.
FORMAT = 3
#: Where each array of a payload starts: a multiple of this many bytes (what a
#: GPU kernel's vector loads from a view of the payload's buffer need).
ALIGN = 64
MAGIC = b"MKVS"
_HEADER = struct.Struct("<4sHI")  # magic, format, header length

DTYPES = {"f16le": mx.float16, "bf16le": mx.bfloat16}


class ChunkFormatError(ValueError):
    """A stored object that is not what its key promises (a miss, never served)."""


# -- names ------------------------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """What a chain of names is valid for: one model, one layer plan, one encoding."""

    key: bytes
    encoding: str
    #: per cache entry: (kind, kv_heads, head_dim)
    plan: Tuple[Tuple[str, int, int], ...]
    window: int

    @cached_property  # a rebuild asks once per chunk: worked out once
    def global_layers(self) -> Tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.plan) if p[0] == LayerKind.GLOBAL.value)

    @cached_property
    def sliding_layers(self) -> Tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.plan) if p[0] == LayerKind.SLIDING.value)

    def kv_dims(self, layers: Sequence[int]) -> Tuple[int, ...]:
        return tuple(self.plan[i][1] * self.plan[i][2] for i in layers)

    def shape(self, layers: Sequence[int]) -> Tuple[Tuple[Tuple[int, ...], int], ...]:
        """``Rows.shape`` of rows of ``layers`` in this scope."""
        dims = self.kv_dims(layers)
        return tuple((at, dims[at[0]]) for at in blocks_of(dims))


def scope_for(geometry: MuseGeometry, encoding: str, fingerprint: Mapping[str, str]) -> Scope:
    """The scope of lists of ``geometry`` (its ``max_context`` aside: rows do not
    depend on it) holding ``encoding`` planes of the model ``fingerprint``."""
    plan = tuple((geometry.layer_kind(i).value, *geometry.layer_dims(i))
                 for i in range(geometry.num_layers))
    doc = {"format": FORMAT, "chunk": CHUNK, "model": dict(sorted(fingerprint.items())),
           "encoding": encoding, "window": geometry.window, "plan": [list(p) for p in plan],
           "model_layers": geometry.model_layers}
    key = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()
    return Scope(key, encoding, plan, geometry.window)


def token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def chain(scope: Scope, tokens: Sequence[int], chunks: int) -> List[bytes]:
    """``K[0] .. K[chunks]`` for the first ``CHUNK * chunks`` of ``tokens``."""
    names = [scope.key]
    for j in range(chunks):
        names.append(hashlib.sha256(names[-1] + token_bytes(tokens[CHUNK * j:CHUNK * (j + 1)])).digest())
    return names


def object_key(kind: str, name: bytes, tail: Optional[Sequence[int]] = None) -> str:
    """The key of object ``kind`` (``G``, ``S``, ``P``, ``I``) at chain name ``name``
    (a point's also covers its tail tokens)."""
    h = hashlib.sha256(kind.encode() + name)
    if kind == "P":
        h.update(token_bytes(tail or ()))
    return h.hexdigest()


# -- records -----------------------------------------------------------------------


def blocks_of(kv_dims: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
    """How rows of layers with these ``kv_dims`` are kept: the indices of the
    layers, grouped by ``kv_dim`` (in order of first appearance), in order."""
    groups: Dict[int, List[int]] = {}
    for i, dim in enumerate(kv_dims):
        groups.setdefault(int(dim), []).append(i)
    return tuple(tuple(g) for g in groups.values())


@dataclass(frozen=True, eq=False)
class Block:
    """The rows of the layers ``Rows.layers[i] for i in at``, which share one
    ``kv_dim``, layer-major: ``keys``/``values`` are ``[len(at), count, kv_dim]``.
    One array per plane for all of them, so joining or splitting the rows of
    many chunks costs one operation per block, whatever the layer count."""

    at: Tuple[int, ...]
    keys: mx.array
    values: mx.array

    @property
    def kv_dim(self) -> int:
        return int(self.keys.shape[2])


@dataclass(frozen=True, eq=False)
class Rows:
    """Rows ``[start, start + count)`` of some layers, in the planes' dtype, in
    ``blocks`` (``blocks_of`` their kv_dims: one for layers of one kind)."""

    start: int
    count: int
    layers: Tuple[int, ...]
    blocks: Tuple[Block, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.keys.nbytes + b.values.nbytes for b in self.blocks)

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def shape(self) -> Tuple[Tuple[Tuple[int, ...], int], ...]:
        """``(at, kv_dim)`` of each block: what ``_fits`` compares with its scope's."""
        return tuple((b.at, b.kv_dim) for b in self.blocks)

    @property
    def kv_dims(self) -> Tuple[int, ...]:
        dims = [0] * len(self.layers)
        for b in self.blocks:
            for i in b.at:
                dims[i] = b.kv_dim
        return tuple(dims)

    def arrays(self) -> List[mx.array]:
        return [a for b in self.blocks for a in (b.keys, b.values)]

    def part(self, lo: int, hi: int) -> "Rows":
        """Positions ``[lo, hi)`` of these rows (views)."""
        a, b = lo - self.start, hi - self.start
        if not 0 <= a <= b <= self.count:
            raise ValueError(f"rows [{lo}, {hi}) outside [{self.start}, {self.end})")
        return Rows(lo, hi - lo, self.layers,
                    tuple(Block(k.at, k.keys[:, a:b], k.values[:, a:b]) for k in self.blocks))


@dataclass(frozen=True, eq=False)
class Point:
    """A put point: its tail tokens, the tail's global rows, and the sliding rows
    of its window that no ``S`` chunk holds (at most two runs)."""

    tail: Tuple[int, ...]
    globals: Rows
    fragments: Tuple[Rows, ...]

    @property
    def nbytes(self) -> int:
        return self.globals.nbytes + sum(f.nbytes for f in self.fragments) + 8 * len(self.tail)


@dataclass(frozen=True)
class Index:
    """The tail lengths of the points stored at one chain name."""

    tails: FrozenSet[int]

    @property
    def nbytes(self) -> int:
        return 8 * len(self.tails) + 64


Stored = Any  # Rows | Point | Index


def for_host(objs: Sequence[Stored]) -> List[Stored]:
    """``objs`` as the byte tiers' writer reads them on the host, their arrays
    evaluated: the memory tier keeps ``objs`` for rebuilds on the GPU, and a host
    read must not move their buffers (``managed.host_copies``). One evaluation."""
    if not managed.host_reads_move():
        return list(objs)
    copies = managed.host_copies([a for obj in objs for a in arrays_of(obj)])
    mx.eval(copies)
    it = iter(copies)
    return [_rebuilt(obj, it) for obj in objs]


def arrays_of(obj: Stored) -> List[mx.array]:
    if isinstance(obj, Rows):
        return obj.arrays()
    if isinstance(obj, Point):
        return [a for r in (obj.globals, *obj.fragments) for a in r.arrays()]
    return []


def _rebuilt(obj: Stored, arrays: Iterator[mx.array]) -> Stored:
    """``obj`` with its arrays, in ``arrays_of`` order, taken from ``arrays``."""
    if isinstance(obj, Rows):
        return Rows(obj.start, obj.count, obj.layers,
                    tuple(Block(b.at, next(arrays), next(arrays)) for b in obj.blocks))
    if isinstance(obj, Point):
        return Point(obj.tail, _rebuilt(obj.globals, arrays),
                     tuple(_rebuilt(f, arrays) for f in obj.fragments))
    return obj


def shaped_rows(scope: Scope, layers: Sequence[int], start: int, count: int) -> Rows:
    """Rows ``[start, start + count)`` of ``layers`` as ``scope`` shapes them,
    of zeros never evaluated: what an object's size is worked out from."""
    dims, dtype = scope.kv_dims(layers), DTYPES[scope.encoding]
    blocks = []
    for at in blocks_of(dims):
        shape = (len(at), count, dims[at[0]])
        blocks.append(Block(at, mx.zeros(shape, dtype), mx.zeros(shape, dtype)))
    return Rows(start, count, tuple(layers), tuple(blocks))


def nbytes(obj: Stored) -> int:
    return int(obj.nbytes)


# -- bytes ---------------------------------------------------------------------------


def _rows_doc(rows: Rows) -> Dict[str, Any]:
    return {"start": rows.start, "count": rows.count, "layers": list(rows.layers),
            "kv_dims": list(rows.kv_dims)}


def _words(a: mx.array) -> np.ndarray:
    return np.asarray(a.view(mx.uint16))  # f16 and bf16 alike: 2-byte words


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(obj: Stored, encoding: str) -> Tuple[bytes, List[mx.array]]:
    """What ``encode`` writes for ``obj``: its header's bytes and its arrays."""
    arrays: List[mx.array] = []
    if isinstance(obj, Index):
        doc: Dict[str, Any] = {"kind": "I", "tails": sorted(obj.tails)}
    elif isinstance(obj, Rows):
        doc = {"kind": "R", "rows": [_rows_doc(obj)]}
        arrays = obj.arrays()
    elif isinstance(obj, Point):
        parts = (obj.globals, *obj.fragments)
        doc = {"kind": "P", "tail": list(obj.tail), "rows": [_rows_doc(r) for r in parts]}
        arrays = [a for r in parts for a in r.arrays()]
    else:
        raise TypeError(f"not a stored object: {type(obj).__name__}")
    doc["encoding"] = encoding
    header = json.dumps(doc, sort_keys=True).encode()
    return _HEADER.pack(MAGIC, FORMAT, len(header)) + header, arrays


def encoded_size(obj: Stored, encoding: str) -> int:
    """``len(encode(obj, encoding))``, from shapes alone (no array is evaluated)."""
    head, arrays = _layout(obj, encoding)
    at = len(head)
    for a in arrays:
        at = _padded(at) + 2 * a.size
    return _padded(at)


def encode(obj: Stored, encoding: str) -> memoryview:
    """The bytes of a stored object (the tiers frame and digest them), as a
    flat byte view of one buffer of ``encoded_size`` bytes. The buffer comes
    zeroed from the allocator and each array is copied into it once by NumPy,
    which releases the GIL for the copy: the store's write-behind thread holds
    the GIL for a few calls per chunk, not for a pass over its bytes, so the
    generation thread keeps building steps while a chunk is encoded."""
    head, arrays = _layout(obj, encoding)
    out = np.zeros(encoded_size(obj, encoding), dtype=np.uint8)
    out[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    at = len(head)
    for a in arrays:
        at = _padded(at)
        n = 2 * a.size
        np.copyto(out[at:at + n].view(np.uint16).reshape(a.shape), _words(a))
        at += n
    return out.data


Payload = Union[bytes, bytearray, memoryview, mx.array]


def decode(payload: Payload, encoding: str) -> Stored:
    """The object ``encode`` wrote, checked whole (``ChunkFormatError`` otherwise).
    An evaluated 1-D ``uint8`` MLX array (a tier read into host-visible memory)
    is decoded into views of it; bytes are copied into one such array first."""
    if isinstance(payload, mx.array):
        if payload.dtype != mx.uint8 or payload.ndim != 1:
            raise TypeError(f"a chunk's payload array is 1-D uint8, got {payload.dtype} "
                            f"{payload.shape}")
        data: Optional[mx.array] = payload
        host = np.asarray(payload)
    else:
        data, host = None, np.frombuffer(payload, dtype=np.uint8)
    size = host.nbytes
    try:
        magic, version, length = _HEADER.unpack_from(host.data, 0)
        if magic != MAGIC or version != FORMAT:
            raise ChunkFormatError(f"expected {MAGIC!r} format {FORMAT}, got {magic!r} {version}")
        at = _HEADER.size + length
        doc = json.loads(host[_HEADER.size:at].tobytes())
        if doc.get("encoding") != encoding:
            raise ChunkFormatError(f"expected encoding {encoding}, got {doc.get('encoding')}")
        if doc["kind"] == "I":
            if _padded(at) != size:
                raise ChunkFormatError(f"index of {size} bytes, expected {_padded(at)}")
            return Index(frozenset(int(t) for t in doc["tails"]))
        dtype = DTYPES[encoding]
        parts = []
        for r in doc["rows"]:
            count, layers = int(r["count"]), tuple(int(i) for i in r["layers"])
            dims = [int(d) for d in r["kv_dims"]]
            if len(dims) != len(layers) or count < 0 or min(dims, default=1) <= 0:
                raise ChunkFormatError(f"rows of {len(layers)} layers with kv_dims {dims}, "
                                       f"count {count}")
            blocks = []
            for group in blocks_of(dims):
                shape = (len(group), count, dims[group[0]])
                words = shape[0] * shape[1] * shape[2]
                pair = []
                for _ in ("keys", "values"):
                    at = _padded(at)
                    if at + 2 * words > size:
                        raise ChunkFormatError(f"truncated: {size} bytes, rows need "
                                               f"{at + 2 * words}")
                    if data is None:  # one copy of the whole payload, then views of it
                        data = mx.array(host)
                        managed.to_gpu(np.asarray(data))
                    pair.append(data[at:at + 2 * words].view(dtype).reshape(shape))
                    at += 2 * words
                blocks.append(Block(group, pair[0], pair[1]))
            parts.append(Rows(int(r["start"]), count, layers, tuple(blocks)))
        if _padded(at) != size:
            raise ChunkFormatError(f"{size - at} bytes past the last row")
        if doc["kind"] == "R" and len(parts) == 1:
            return parts[0]
        if doc["kind"] == "P" and parts:
            return Point(tuple(int(t) for t in doc["tail"]), parts[0], tuple(parts[1:]))
        raise ChunkFormatError(f"unknown object kind {doc['kind']!r}")
    except ChunkFormatError:
        raise
    except (KeyError, TypeError, ValueError, struct.error) as e:
        raise ChunkFormatError(f"unreadable stored object: {e}") from e
