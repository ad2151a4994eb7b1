"""The session file: one safetensors file per session, its header (format,
version, geometry, position, encoding, starts, digests, the model's
fingerprint, user metadata, ``header_sha256``) and the check of a header, the
tensors' digests and how a tensor's bytes are stored, and the errors every
refusal raises. The checks of a file's tensors against its header:
``muser_kv.sessions.verify``.

* **What the digests protect against: accidents.** Bit rot, torn or truncated
  writes, a file edited or swapped by mistake (a random change goes unnoticed
  with a chance of about 2^-128; XXH3 is no CRC, so no error pattern is
  caught with certainty). XXH3-128 is not cryptographic, and no digest in
  the file is a signature: whoever can write the file can recompute every
  digest (sha256 included), so a session file is as trustworthy as the place
  it is kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import mlx.core as mx
import numpy as np
import xxhash

from muser_kv.core.geometry import LayerKind, MuseGeometry
from muser_kv.sessions import tensorfile
from muser_kv.sessions.fingerprint import check_fingerprint

FORMAT = "muser-kv-session"
#: The version written. Version 2 added the header checksum and the model
#: fingerprint (version 1 files, with neither, are refused: their header cannot
#: be verified); version 3 changed only the tensors' digest, sha256 -> XXH3-128
#: (why: docs/sessions.md, "The file").
VERSION = "3"
#: version read -> the digest of every tensor's bytes in files of that version
#: (the header's own checksum, ``header_sha256``, is sha256 in both).
TENSOR_DIGESTS = {"2": "sha256", "3": "xxh3-128"}
#: digest -> the length of its lowercase hex
DIGEST_HEX = {"sha256": 64, "xxh3-128": 32}
#: The digest this version writes.
TENSOR_DIGEST = TENSOR_DIGESTS[VERSION]
F16LE = "f16le"
BF16LE = "bf16le"
F32LE = "f32le"
#: encoding -> (MLX dtype in memory, safetensors dtype on disk)
ENCODINGS: Dict[str, Tuple[Any, str]] = {
    F16LE: (mx.float16, "F16"),
    BF16LE: (mx.bfloat16, "BF16"),
    F32LE: (mx.float32, "F32"),
}
#: plane dtype -> the encoding its snapshots carry
PLANE_ENCODINGS = {mx.float16: F16LE, mx.bfloat16: BF16LE}


def plane_encoding(dtype: Any) -> str:
    """The encoding of planes of ``dtype`` (f16 -> ``f16le``, bf16 -> ``bf16le``)."""
    return PLANE_ENCODINGS[dtype]


#: The geometry fields that shape the stored KV state (``num_heads`` does not).
KV_FIELDS = ("num_layers", "layer_kinds", "window", "max_context", "kv_heads", "head_dim")
#: Fields a header's geometry carries only where they are not 0 (a geometry whose
#: global layers have other K/V heads or head_dim, or whose model has layers without
#: a cache): a Muse Glimmer session's header is what it has always been.
KV_EXTRA_FIELDS = ("global_kv_heads", "global_head_dim", "model_layers")


def kv_num_heads(kv_heads: int, global_kv_heads: int) -> int:
    """The query-head count a KV geometry records: never part of the K/V state,
    so the least count both kinds' K/V heads divide."""
    return math.lcm(kv_heads, global_kv_heads or kv_heads)


#: The header field holding the sha256 over every other header field.
HEADER_CHECKSUM = "header_sha256"
#: Header keys every session file carries (``__metadata__``, str -> str), and no others.
HEADER_KEYS = ("format", "version", "geometry", "position", "encoding", "starts", "checksums",
               "user", "model", HEADER_CHECKSUM)

PathLike = Union[str, "os.PathLike[str]"]


# -- errors -------------------------------------------------------------------


class SnapshotError(ValueError):
    """Base of every snapshot refusal."""


class SnapshotMismatch(SnapshotError):
    """A snapshot does not fit its target: names the layer, field, expected, got."""

    def __init__(self, field: str, expected: Any, got: Any, layer: Optional[int] = None,
                 kind: Optional[LayerKind] = None):
        self.field = field
        self.expected = expected
        self.got = got
        self.layer = layer
        self.kind = kind
        where = "session snapshot"
        if layer is not None:
            where += f" layer {layer}" + (f" ({LayerKind(kind).value})" if kind is not None else "")
        super().__init__(f"{where}: {field} expected {expected!r}, got {got!r}")

    def __reduce__(self):  # picklable despite the keyword-rich constructor
        return type(self), (self.field, self.expected, self.got, self.layer, self.kind)


class EncodingMismatch(SnapshotError):
    """A snapshot whose encoding is not the target planes' (``convert=True`` rounds it)."""

    def __init__(self, encoding: str, expected: str = F16LE):
        self.encoding = encoding
        self.expected = expected
        super().__init__(
            f"session snapshot is {encoding}, but the live planes are "
            f"{ENCODINGS[expected][0]} and install only {expected}: pass convert=True "
            f"to round it to {expected} (nearest even)"
        )

    def __reduce__(self):
        return type(self), (self.encoding, self.expected)


class ProductionF16Required(EncodingMismatch):
    """A snapshot of another encoding (f32 interchange, or bf16) offered to f16
    production planes."""

    def __init__(self, encoding: str, expected: str = F16LE):
        super().__init__(encoding, F16LE)


class ModelMismatch(SnapshotMismatch):
    """A session offered to a model other than the one it was saved from (by
    fingerprint), or one that records no model: ``allow_other_model=True``
    loads it anyway."""

    def __reduce__(self):
        return type(self), (self.field, self.expected, self.got, self.layer, self.kind)


class SessionMetadataError(SnapshotError, TypeError):
    """User metadata that cannot be stored as JSON, exactly."""


def encoding_mismatch(encoding: str, expected: str) -> EncodingMismatch:
    """The refusal of a session in ``encoding`` for planes of ``expected``."""
    return ProductionF16Required(encoding) if expected == F16LE else EncodingMismatch(
        encoding, expected)


class SessionFileError(SnapshotError):
    """A session file that cannot be trusted (unreadable, truncated, unknown format
    or version, wrong encoding, missing or corrupted tensor)."""

    def __init__(self, path: PathLike, problem: str):
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"session file {self.path}: {problem}")

    def __reduce__(self):
        return type(self), (self.path, self.problem)



# -- the file -----------------------------------------------------------------


def tensor_names(layer: int) -> Tuple[str, str]:
    return f"layers.{layer}.keys", f"layers.{layer}.values"


def hasher(algorithm: str) -> Any:
    """A new incremental hash of ``algorithm`` (a key of ``DIGEST_HEX``)."""
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"tensor digest expected one of {sorted(DIGEST_HEX)}, got {algorithm!r}")


def digest_bytes(data: Any, algorithm: str = TENSOR_DIGEST) -> str:
    """``algorithm``'s lowercase hex digest of a C-contiguous buffer's bytes, in one
    call (both hashes let go of the GIL while they hash a large buffer)."""
    h = hasher(algorithm)
    h.update(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return h.hexdigest()


def stored_view(x: mx.array) -> np.ndarray:
    """An MLX array's bytes as numpy in their safetensors storage dtype (bf16 as
    its uint16 bits), evaluating it if need be: a view of MLX's buffer, no
    copy. What a file's tensor holds, what a digest is taken of."""
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.asarray(x)


def tensor_digest(array: np.ndarray, algorithm: str = TENSOR_DIGEST) -> str:
    """``algorithm`` (hex) of an array's raw little-endian bytes."""
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return digest_bytes(a.view(np.uint8).reshape(-1), algorithm)


def tensor_digests(arrays: Mapping[str, np.ndarray],
                   algorithm: str = TENSOR_DIGEST) -> Dict[str, str]:
    """``tensor_digest`` of every array, on a few threads (the hashes let go of
    the GIL, so a full-depth session's 104 tensors hash in parallel)."""
    names = list(arrays)
    if not names:
        return {}
    with ThreadPoolExecutor(min(len(names), tensorfile.workers())) as pool:
        return dict(zip(names, pool.map(lambda n: tensor_digest(arrays[n], algorithm), names)))


def geometry_to_json(geometry: MuseGeometry) -> str:
    g = {name: getattr(geometry, name) for name in KV_FIELDS}
    g.update({name: getattr(geometry, name) for name in KV_EXTRA_FIELDS if getattr(geometry, name)})
    g["layer_kinds"] = [k.value for k in geometry.layer_kinds]
    return json.dumps(g, sort_keys=True, separators=(",", ":"))


def header_digest(metadata: Mapping[str, str]) -> str:
    """The ``header_sha256`` of a header: sha256 (hex) of the compact, ASCII
    JSON array of ``[key, value]`` pairs of every other field, sorted by key.
    It covers every byte of every field's key and value, so no field can change
    -- nor one appear or go -- without it changing."""
    pairs = sorted([k, v] for k, v in metadata.items() if k != HEADER_CHECKSUM)
    text = json.dumps(pairs, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _show(value: Any) -> str:
    """A short repr of a value read from a file, safe at any nesting depth."""
    return tensorfile.show(value)


def _json(metadata: Mapping[str, str], key: str, path: PathLike) -> Any:
    """A header field's JSON value; anything that does not parse (malformed,
    nested past what the parser takes, numbers past its limits) is refused."""
    try:
        return json.loads(metadata[key])
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise SessionFileError(path, f"header field {key!r}: expected JSON, got text that is "
                                     f"not ({why})") from None


def _geometry_from_json(metadata: Mapping[str, str], path: PathLike) -> MuseGeometry:
    g = _json(metadata, "geometry", path)
    try:
        if (not isinstance(g, dict) or not set(KV_FIELDS) <= set(g)
                or not set(g) <= set(KV_FIELDS + KV_EXTRA_FIELDS)):
            raise ValueError(f"fields expected {sorted(KV_FIELDS)} (and any of "
                             f"{sorted(KV_EXTRA_FIELDS)}), got "
                             f"{_show(sorted(g)) if isinstance(g, dict) else type(g).__name__}")
        if not isinstance(g["layer_kinds"], list):
            raise ValueError(f"layer_kinds expected a list, got {type(g['layer_kinds']).__name__}")
        for name in KV_EXTRA_FIELDS:
            if name in g and (isinstance(g[name], bool) or not isinstance(g[name], int)
                              or g[name] <= 0):
                raise ValueError(f"{name} expected a positive int, got {_show(g[name])}")
        heads = g["kv_heads"] if isinstance(g["kv_heads"], int) else 1
        global_heads = g.get("global_kv_heads", 0)
        g = dict(g, num_heads=kv_num_heads(heads, global_heads) if heads > 0 else heads,
                 layer_kinds=tuple(g["layer_kinds"]))
        return MuseGeometry(**g)
    except (ValueError, TypeError, KeyError) as e:
        raise SessionFileError(path, f"bad geometry in header: {e}") from None


@dataclass(frozen=True)
class SessionHeader:
    """The parsed ``__metadata__`` of a session file."""

    format: str
    version: str
    geometry: MuseGeometry
    position: int
    encoding: str
    starts: Tuple[int, ...]
    checksums: Dict[str, str]
    user: Dict[str, Any]
    model: Optional[Dict[str, str]] = None

    @property
    def tensor_names(self) -> List[str]:
        return [n for i in range(self.geometry.num_layers) for n in tensor_names(i)]

    @property
    def digest(self) -> str:
        """The digest of this file's tensors (``TENSOR_DIGESTS[version]``)."""
        return TENSOR_DIGESTS[self.version]


def parse_header(metadata: Optional[Mapping[str, str]], path: PathLike) -> SessionHeader:
    """Check and parse a session file's header; ``SessionFileError`` names what is wrong.

    Format and version are compared with constants first (so a file that is
    not a session, or of another version, says so); then the header checksum
    is verified, before any other field is read."""
    metadata = metadata or {}
    fmt = metadata.get("format")
    if fmt != FORMAT:
        raise SessionFileError(path, f"format expected {FORMAT!r}, got {_show(fmt)}")
    version = metadata.get("version")
    if version not in TENSOR_DIGESTS:
        why = (" (version 1 files carry no header checksum and no model fingerprint, so "
               "their header cannot be verified: rebuild the session from its prompt)"
               if version == "1" else "")
        raise SessionFileError(path, f"unsupported version: expected one of "
                                     f"{sorted(TENSOR_DIGESTS)}, got {_show(version)}{why}")
    recorded = metadata.get(HEADER_CHECKSUM)
    if not isinstance(recorded, str) or not _HEX64.fullmatch(recorded):
        raise SessionFileError(path, f"header checksum ({HEADER_CHECKSUM}) expected 64 lowercase "
                                     f"hex digits, got {_show(recorded)}")
    computed = header_digest(metadata)
    if computed != recorded:
        raise SessionFileError(path, f"corrupted header (checksum mismatch): {HEADER_CHECKSUM} "
                                     f"expected {recorded}, got {computed}")
    missing = [k for k in HEADER_KEYS if k not in metadata]
    if missing:
        raise SessionFileError(path, f"header fields missing: {missing}")
    extra = sorted(set(metadata) - set(HEADER_KEYS))
    if extra:
        raise SessionFileError(path, f"header fields expected {list(HEADER_KEYS)}, got also "
                                     f"{_show(extra)}")
    encoding = metadata["encoding"]
    if encoding not in ENCODINGS:
        raise SessionFileError(path, f"unknown encoding: expected one of {sorted(ENCODINGS)}, "
                                     f"got {_show(encoding)}")
    geometry = _geometry_from_json(metadata, path)
    position = _json(metadata, "position", path)
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise SessionFileError(path, f"position expected a non-negative int, got {_show(position)}")
    starts = _json(metadata, "starts", path)
    if (not isinstance(starts, list) or len(starts) != geometry.num_layers
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in starts)):
        raise SessionFileError(path, f"starts expected {geometry.num_layers} ints, got "
                                     f"{_show(starts)}")
    checksums = _json(metadata, "checksums", path)
    if not isinstance(checksums, dict) or not all(isinstance(v, str) for v in checksums.values()):
        raise SessionFileError(path, f"checksums expected a JSON object of hex strings, got "
                                     f"{_show(checksums)}")
    user = _json(metadata, "user", path)
    if not isinstance(user, dict):
        raise SessionFileError(path, f"user metadata expected a JSON object, got {_show(user)}")
    try:
        model = check_fingerprint(_json(metadata, "model", path))
    except ValueError as e:
        raise SessionFileError(path, f"model fingerprint: {e}") from None
    return SessionHeader(fmt, version, geometry, position, encoding, tuple(starts),
                         checksums, user, model)
