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

Rows are the planes' values, never converted: ``[count, kv_dim]`` per layer in
token order, in the planes' dtype (the layers in list order within their kind).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from muser_kv.core.geometry import LayerKind, MuseGeometry

#: Positions per chunk.
CHUNK = 256
#: The version of the object format below (part of every scope).
FORMAT = 1
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

    @property
    def global_layers(self) -> Tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.plan) if p[0] == LayerKind.GLOBAL.value)

    @property
    def sliding_layers(self) -> Tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.plan) if p[0] == LayerKind.SLIDING.value)

    def kv_dims(self, layers: Sequence[int]) -> Tuple[int, ...]:
        return tuple(self.plan[i][1] * self.plan[i][2] for i in layers)


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


@dataclass(frozen=True, eq=False)
class Rows:
    """Rows ``[start, start + count)`` of some layers: ``keys[i]``/``values[i]``
    are ``[count, kv_dim]`` of ``layers[i]``, in the planes' dtype."""

    start: int
    count: int
    layers: Tuple[int, ...]
    keys: Tuple[mx.array, ...]
    values: Tuple[mx.array, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    @property
    def end(self) -> int:
        return self.start + self.count

    def part(self, lo: int, hi: int) -> "Rows":
        """Positions ``[lo, hi)`` of these rows (views)."""
        a, b = lo - self.start, hi - self.start
        if not 0 <= a <= b <= self.count:
            raise ValueError(f"rows [{lo}, {hi}) outside [{self.start}, {self.end})")
        return Rows(lo, hi - lo, self.layers, tuple(k[a:b] for k in self.keys),
                    tuple(v[a:b] for v in self.values))


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


def nbytes(obj: Stored) -> int:
    return int(obj.nbytes)


# -- bytes ---------------------------------------------------------------------------


def _rows_doc(rows: Rows) -> Dict[str, Any]:
    return {"start": rows.start, "count": rows.count, "layers": list(rows.layers),
            "kv_dims": [int(k.shape[1]) if k.ndim == 2 else 0 for k in rows.keys]}


def _raw(a: mx.array) -> bytes:
    return np.asarray(a.view(mx.uint16)).tobytes()  # f16 and bf16 alike: 2-byte words


def encode(obj: Stored, encoding: str) -> bytes:
    """The bytes of a stored object (the tiers frame and digest them)."""
    arrays: List[mx.array] = []
    if isinstance(obj, Index):
        doc: Dict[str, Any] = {"kind": "I", "tails": sorted(obj.tails)}
    elif isinstance(obj, Rows):
        doc = {"kind": "R", "rows": [_rows_doc(obj)]}
        arrays = [a for pair in zip(obj.keys, obj.values) for a in pair]
    elif isinstance(obj, Point):
        parts = (obj.globals, *obj.fragments)
        doc = {"kind": "P", "tail": list(obj.tail), "rows": [_rows_doc(r) for r in parts]}
        arrays = [a for r in parts for pair in zip(r.keys, r.values) for a in pair]
    else:
        raise TypeError(f"not a stored object: {type(obj).__name__}")
    doc["encoding"] = encoding
    header = json.dumps(doc, sort_keys=True).encode()
    return b"".join([_HEADER.pack(MAGIC, FORMAT, len(header)), header, *(_raw(a) for a in arrays)])


def decode(blob: bytes, encoding: str) -> Stored:
    """The object ``encode`` wrote, checked whole (``ChunkFormatError`` otherwise)."""
    try:
        magic, version, length = _HEADER.unpack_from(blob, 0)
        if magic != MAGIC or version != FORMAT:
            raise ChunkFormatError(f"expected {MAGIC!r} format {FORMAT}, got {magic!r} {version}")
        at = _HEADER.size + length
        doc = json.loads(blob[_HEADER.size:at])
        if doc.get("encoding") != encoding:
            raise ChunkFormatError(f"expected encoding {encoding}, got {doc.get('encoding')}")
        if doc["kind"] == "I":
            if at != len(blob):
                raise ChunkFormatError(f"index of {len(blob)} bytes, expected {at}")
            return Index(frozenset(int(t) for t in doc["tails"]))
        dtype = DTYPES[encoding]
        parts = []
        for r in doc["rows"]:
            keys: List[mx.array] = []
            values: List[mx.array] = []
            for dim in r["kv_dims"]:
                size = 2 * int(r["count"]) * int(dim)
                for out in (keys, values):
                    if at + size > len(blob):
                        raise ChunkFormatError(f"truncated: {len(blob)} bytes, rows need {at + size}")
                    words = np.frombuffer(blob, dtype="<u2", count=size // 2, offset=at)
                    out.append(mx.array(words).view(dtype).reshape(int(r["count"]), int(dim)))
                    at += size
            parts.append(Rows(int(r["start"]), int(r["count"]), tuple(int(i) for i in r["layers"]),
                              tuple(keys), tuple(values)))
        if at != len(blob):
            raise ChunkFormatError(f"{len(blob) - at} bytes past the last row")
        if doc["kind"] == "R" and len(parts) == 1:
            return parts[0]
        if doc["kind"] == "P" and parts:
            return Point(tuple(int(t) for t in doc["tail"]), parts[0], tuple(parts[1:]))
        raise ChunkFormatError(f"unknown object kind {doc['kind']!r}")
    except ChunkFormatError:
        raise
    except (KeyError, TypeError, ValueError, struct.error) as e:
        raise ChunkFormatError(f"unreadable stored object: {e}") from e
