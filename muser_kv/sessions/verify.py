"""A session file's tensors checked against its verified header, by both
readers (the whole-file ``SessionFile`` and the streamed ``Reader``).

The table checks run before a byte of data is read: every tensor the header
names is present, of the header's encoding, with a digest, and no tensor or
digest the header does not name is there. Each tensor's digest then decides
it. The first failure, in the header's tensor order, is the refusal: a
``SessionFileError`` naming the tensor, what was expected and what came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping

from muser_kv.sessions import tensorfile
from muser_kv.sessions.format import ENCODINGS, PathLike, SessionFileError, SessionHeader


@dataclass(frozen=True)
class TensorCheck:
    """One tensor's verification: ``status`` is OK, MISSING, UNEXPECTED, DTYPE or MISMATCH."""

    name: str
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "OK"


def table_checks(h: SessionHeader, stored: Mapping[str, str]) -> Dict[str, TensorCheck]:
    """What the header and the tensor table (name -> safetensors dtype) say
    before a byte of data is read. Tensors that pass are absent from the
    result (their digest decides)."""
    want = ENCODINGS[h.encoding][1]
    out: Dict[str, TensorCheck] = {}
    for name in h.tensor_names:
        dtype = stored.get(name)
        if dtype is None:
            out[name] = TensorCheck(name, "MISSING", "tensor missing from the file")
        elif dtype != want:
            out[name] = TensorCheck(name, "DTYPE", f"encoding {h.encoding} expects dtype "
                                    f"{tensorfile.DTYPE_NAMES[want]}, got "
                                    f"{tensorfile.DTYPE_NAMES[dtype]}")
        elif name not in h.checksums:
            out[name] = TensorCheck(name, "MISMATCH", "no checksum in the header")
    expected = set(h.tensor_names)
    for n in sorted(set(stored) - expected):
        out[n] = TensorCheck(n, "UNEXPECTED", "tensor not named by the header")
    for n in sorted(set(h.checksums) - expected):
        out[n] = TensorCheck(n, "UNEXPECTED", "checksum for a tensor the geometry does not have")
    return out


def digest_check(h: SessionHeader, name: str, digest: str) -> TensorCheck:
    """Tensor ``name``'s ``digest`` (of the file's version) against the header's."""
    if digest != h.checksums[name]:
        return TensorCheck(name, "MISMATCH", f"{h.digest} expected {h.checksums[name]}, "
                                             f"got {digest}")
    return TensorCheck(name, "OK")


def refusal(path: PathLike, check: TensorCheck) -> SessionFileError:
    """The refusal of a file for a failed ``check``."""
    what = {"MISSING": "missing tensor", "UNEXPECTED": "unexpected tensor",
            "DTYPE": "wrong encoding for tensor",
            "MISMATCH": "corrupted tensor (checksum mismatch)"}[check.status]
    return SessionFileError(path, f"{what} {check.name!r}: {check.detail}")


def first_refusal(path: PathLike, h: SessionHeader, checks: Mapping[str, TensorCheck]) -> None:
    """Raise for the first failing check: the header's tensors in order, then the rest."""
    for name in h.tensor_names + sorted(set(checks) - set(h.tensor_names)):
        check = checks.get(name)
        if check is not None and not check.ok:
            raise refusal(path, check)
