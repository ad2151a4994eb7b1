"""Sessions handed between processes over MLX's distributed layer: prefill
here, decode there.

``send_session(cache, dst, group)`` cuts a live cache list and streams it to
rank ``dst``; ``recv_session(model, src, group)`` installs it, bit for bit, into
a new cache list for ``model`` (or into ``into=``, an existing one). Transfers
are ``mx.distributed.send`` / ``recv`` on ``group`` (the ring backend over TCP
here; MPI, NCCL and JACCL groups take the same calls).

Invariants:

* **What travels is a session file's content.** The header is the one
  ``save_session`` writes (``snapshot.py`` builds both: format, version,
  geometry, position, encoding, starts, per-tensor sha256, user metadata, model
  fingerprint, ``header_sha256``), and the tensors are the file's, in layer
  order. The receiver checks it with ``snapshot.py``'s own functions
  (``parse_header``, the geometry gate, ``check_model``, ``tensor_digests``,
  ``SessionSnapshot.check``), so a change there applies here unchanged.
* **Nothing from the wire is trusted before it is verified.** The header
  checksum is checked before any field is read; geometry, encoding and model
  fingerprint before a tensor is accepted; every tensor's shape and dtype come
  from the verified header, never from the wire, and its bytes must match the
  header's digest before its layer is installed.
* **Streamed, all or nothing.** Layer ``i`` is installed (at rotation ``start
  % capacity``, ``MuseKVCache.install``) as soon as its keys and values have
  arrived and matched their digests, while later layers are still in flight.
  The cache is handed back only when every layer is in and the snapshot gate
  has passed; on any refusal or failure a new cache is dropped, and ``into``
  gets every layer's planes and ring back as they were.
* **A refusal keeps the link in step.** The receiver answers the header with a
  verdict (so a refused session's tensors never travel) and the tensors with a
  final one; after a refusal at a tensor it still takes the rest of the stream.
  The sender raises ``HandoffRefused`` with the receiver's reason, and the next
  session on the link goes through.
* **A failure of the link itself ends it.** A peer lost, a message that does
  not come within its bound, or bytes that are not this protocol's break the
  link for good: MLX cannot cancel a posted transfer, so the stream position is
  unknown; every later call on that (group, peer) raises ``LinkBroken`` at once.
* **Bounded waits.** Every transfer runs on the link's courier: one daemon
  thread with its own CPU stream (MLX streams are per thread), running the
  link's sends and receives in order. The caller waits for each message --
  preamble, header, verdict, one tensor -- at most ``timeout`` seconds (the
  first message of ``recv_session`` at most ``wait``, default: until a session
  or a lost connection). A peer that exits or is killed closes its sockets and
  MLX's ring backend reports it at once (``PeerLost``); a peer that is alive
  but silent is caught by the bound (``HandoffTimeout``).

Limits (MLX 0.32's ring backend, CPython 3.11):

* ``timeout`` bounds silence, not the whole transfer: a peer that keeps
  sending slowly keeps it going (at most messages x ``timeout``); and any
  expired bound, ``wait`` included, breaks the link (the posted receive would
  take the next session's first bytes).
* A courier left blocked by an expired bound stays blocked until the peer
  sends or closes. It does not hold the process up, but should MLX complete
  that transfer while the interpreter shuts down, CPython ends the thread by a
  forced unwind that MLX's C++ frames refuse, and the process aborts
  (SIGABRT). A process whose link broke ends with ``os._exit`` once its
  output is flushed (``examples/disaggregated.py`` does).
* A posted receive busy-polls its socket (MLX's socket thread retries on
  ``EAGAIN`` without sleeping): a receiver waiting for a session keeps about
  one core busy meanwhile.
* Transfers run on a CPU stream: ring, MPI and JACCL groups transfer from the
  CPU; an NCCL group would need the courier's stream on the GPU (not tried).
* The header, its per-tensor digests included, is built before the first
  byte goes out: the sender hashes the whole session first, as a save does.

Wire, per session (sender S, receiver R; all integers little-endian):
S->R preamble (``PREAMBLE``: magic, wire version, header length, CRC32), S->R
the header (compact ASCII JSON of the header fields), R->S verdict (``VERDICT``
+ reason text), S->R every non-empty tensor (``layers.{i}.keys``, then
``.values``, ``i`` ascending, as ``[rows, kv_heads, head_dim]`` of the
encoding's dtype), R->S verdict. The CRCs only frame the stream; the session's
integrity is the header's own checksum and digests.
"""

from __future__ import annotations

import json
import queue
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from . import snapshot, tensorfile
from .cache import make_prompt_cache
from .fingerprint import model_fingerprint
from .geometry import MuseGeometry
from .precision import DtypeLike, plane_dtype_for
from .snapshot import (
    ENCODINGS, EncodingMismatch, LayerCut, ProductionF16Required, SessionFileError,
    SessionSnapshot, SnapshotError, SnapshotMismatch,
)

#: Seconds a caller waits for any one message of a transfer in progress.
DEFAULT_TIMEOUT = 30.0
WIRE_VERSION = 1
#: preamble: magic, wire version, reserved, header bytes, CRC32 of the preceding 20 bytes
PREAMBLE = struct.Struct("<8sHHQI")
PREAMBLE_MAGIC = b"MUSERKV\x01"
#: verdict: magic, wire version, code, reason bytes, CRC32 of the reason, CRC32 of the preceding 24 bytes
VERDICT = struct.Struct("<8sHHQII")
VERDICT_MAGIC = b"MUSERKV\x02"
#: verdict codes
ACCEPTED, REFUSED, OUT_OF_STEP = 0, 1, 2
CODES = {ACCEPTED: "accepted", REFUSED: "refused", OUT_OF_STEP: "out of step"}
#: The longest reason a verdict carries (longer ones are cut).
MAX_REASON = 4096


# -- errors ---------------------------------------------------------------------------


class HandoffError(RuntimeError):
    """A handoff that did not happen for a reason of the link or the peer."""


class PeerLost(HandoffError, ConnectionError):
    """The connection to the peer went away (it exited, was killed, or its host)."""


class HandoffTimeout(HandoffError, TimeoutError):
    """A message did not come within its bound; the link is broken from then on."""


class LinkBroken(HandoffError):
    """An earlier failure left this (group, peer) link at an unknown stream position."""


class StreamOutOfStep(HandoffError):
    """The bytes that came are not this protocol's message (wrong magic, version, framing)."""


class HandoffRefused(HandoffError):
    """The receiver refused the session (sender side): ``reason`` is its error."""

    def __init__(self, peer: int, reason: str):
        self.peer = peer
        self.reason = reason
        super().__init__(f"rank {peer} refused the session: {reason}")

    def __reduce__(self):
        return type(self), (self.peer, self.reason)


class PayloadError(SessionFileError):
    """A received session that cannot be trusted: a header or tensor that fails
    its checksum, a malformed header, a tensor set the header does not name."""

    def __init__(self, source: str, problem: str):
        self.path = source
        self.problem = problem
        SnapshotError.__init__(self, f"session {source}: {problem}")

    def __reduce__(self):
        return type(self), (self.path, self.problem)


# -- results ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SentSession:
    """What ``send_session`` handed over: the position, the bytes of tensors and header."""

    position: int
    nbytes: int
    header_nbytes: int


@dataclass(frozen=True, eq=False)
class ReceivedSession:
    """A session installed by ``recv_session``: the cache list (``into`` when given),
    the sender's user metadata, the position of the next token, the tensor bytes."""

    cache: Sequence[Any]
    metadata: Dict[str, Any]
    position: int
    nbytes: int


# -- the courier and the link -------------------------------------------------------------


class _Courier:
    """A daemon thread with its own CPU stream that runs one link's transfers in
    submission order and posts each result (an evaluated array, or the
    exception MLX raised) to the queue the submitter waits on."""

    def __init__(self, name: str):
        self._jobs: "queue.SimpleQueue[Tuple[Any, ...]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream = mx.new_stream(mx.cpu)
        while True:
            op, args, group, done = self._jobs.get()
            try:
                if op == "send":
                    (x, dst) = args
                    mx.eval(mx.distributed.send(x, dst, group=group, stream=stream))
                    done.put(("ok", None))
                else:
                    (shape, dtype, src) = args
                    y = mx.distributed.recv(shape, dtype, src, group=group, stream=stream)
                    mx.eval(y)
                    done.put(("ok", y))
            except BaseException as e:  # handed to the waiting caller
                done.put(("error", e))

    def submit(self, op: str, args: Tuple[Any, ...], group: Any,
               done: "queue.SimpleQueue[Tuple[str, Any]]") -> None:
        self._jobs.put((op, args, group, done))


class _Link:
    """One (group, peer) pair: its courier, its lock, and whether it is broken."""

    def __init__(self, group: Any, peer: int):
        self.group = group  # held: the registry's key is id(group)
        self.peer = peer
        self.courier = _Courier(f"muser-kv handoff rank {group.rank()}<->{peer}")
        self.lock = threading.Lock()
        self.broken: Optional[str] = None
        self._done: "queue.SimpleQueue[Tuple[str, Any]]" = queue.SimpleQueue()
        self.pending = 0

    def check(self) -> None:
        if self.broken is not None:
            raise LinkBroken(f"the handoff link with rank {self.peer} is broken ({self.broken}): "
                             "its stream position is unknown; start a new process group")

    def post_send(self, x: mx.array) -> None:
        mx.eval(x)  # here, on this thread's stream: the courier's stream only transfers
        self.courier.submit("send", (x, self.peer), self.group, self._done)
        self.pending += 1

    def post_recv(self, shape: Tuple[int, ...], dtype: Any) -> None:
        self.courier.submit("recv", (tuple(shape), dtype, self.peer), self.group, self._done)
        self.pending += 1

    def take(self, timeout: Optional[float], what: str) -> Any:
        """The result of the oldest posted transfer, waited for at most ``timeout``
        seconds (None: until it completes or the connection is lost)."""
        if self.pending == 0:
            raise RuntimeError("handoff: waiting for a transfer that was never posted")
        try:
            status, value = self._done.get(timeout=timeout)
        except queue.Empty:
            self.broken = f"timed out after {timeout:g} s waiting for {what}"
            raise HandoffTimeout(f"nothing from rank {self.peer} for {timeout:g} s while "
                                 f"waiting for {what}; the link is broken") from None
        self.pending -= 1
        if status == "error":
            if isinstance(value, RuntimeError) and "connection to a peer was lost" in str(value):
                self.broken = f"connection lost during {what}"
                raise PeerLost(f"rank {self.peer} went away during {what} ({value})") from None
            self.broken = f"{type(value).__name__} during {what}"
            raise HandoffError(f"transfer of {what} with rank {self.peer} failed: "
                               f"{type(value).__name__}: {value}") from value
        return value

    def arrived(self) -> int:
        """Posted transfers that have completed and wait to be taken."""
        return self._done.qsize()

    def drain(self, timeout: float, what: str) -> None:
        while self.pending:
            self.take(timeout, what)

    def fail(self, why: str) -> None:
        self.broken = why


_LINKS: Dict[Tuple[int, int], _Link] = {}
_LINKS_LOCK = threading.Lock()


def _link(group: Any, peer: Any, role: str) -> _Link:
    if group is None or not hasattr(group, "rank"):
        raise TypeError(f"{role} needs an mx.distributed group, got {type(group).__name__}")
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise TypeError(f"{role}: peer rank must be an int, got {type(peer).__name__}")
    rank, size = group.rank(), group.size()
    if not 0 <= peer < size or peer == rank:
        raise ValueError(f"{role}: peer rank expected another rank of the group "
                         f"(0..{size - 1}, not {rank}), got {peer}")
    with _LINKS_LOCK:
        link = _LINKS.get((id(group), peer))
        if link is None or link.group is not group:
            link = _Link(group, peer)
            _LINKS[(id(group), peer)] = link
    return link


def _timeout(value: Optional[float], name: str, allow_none: bool) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} expected a positive number of seconds"
                         f"{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


# -- framing ---------------------------------------------------------------------------


def _bytes_array(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def _array_bytes(x: mx.array) -> bytes:
    return np.asarray(x).tobytes()


def _preamble(header_nbytes: int) -> bytes:
    fields = PREAMBLE.pack(PREAMBLE_MAGIC, WIRE_VERSION, 0, header_nbytes, 0)[:-4]
    return fields + struct.pack("<I", zlib.crc32(fields))


def _read_preamble(raw: bytes, peer: int) -> int:
    magic, version, _, header_nbytes, crc = PREAMBLE.unpack(raw)
    if magic != PREAMBLE_MAGIC:
        raise StreamOutOfStep(f"rank {peer} sent {magic!r} where a session preamble (magic "
                              f"{PREAMBLE_MAGIC!r}) was expected")
    if crc != zlib.crc32(raw[:-4]):
        raise StreamOutOfStep(f"rank {peer} sent a session preamble that fails its CRC32 "
                              f"(expected {crc:#010x}, got {zlib.crc32(raw[:-4]):#010x})")
    if version != WIRE_VERSION:
        raise StreamOutOfStep(f"rank {peer} speaks handoff wire version {version}, "
                              f"expected {WIRE_VERSION}")
    if not 0 < header_nbytes <= tensorfile.MAX_HEADER:
        raise StreamOutOfStep(f"rank {peer} announced a header of {header_nbytes} bytes, "
                              f"expected 1..{tensorfile.MAX_HEADER}")
    return header_nbytes


def _verdict(code: int, reason: str = "") -> Tuple[bytes, bytes]:
    text = reason.encode("utf-8", "replace")[:MAX_REASON]
    fields = VERDICT.pack(VERDICT_MAGIC, WIRE_VERSION, code, len(text), zlib.crc32(text), 0)[:-4]
    return fields + struct.pack("<I", zlib.crc32(fields)), text


def _read_verdict(raw: bytes, peer: int) -> Tuple[int, int, int]:
    magic, version, code, nbytes, text_crc, crc = VERDICT.unpack(raw)
    if magic != VERDICT_MAGIC or crc != zlib.crc32(raw[:-4]):
        raise StreamOutOfStep(f"rank {peer} sent {magic!r}... where a verdict (magic "
                              f"{VERDICT_MAGIC!r}, CRC32-framed) was expected")
    if version != WIRE_VERSION or code not in CODES or nbytes > MAX_REASON:
        raise StreamOutOfStep(f"rank {peer} sent a verdict of wire version {version}, code "
                              f"{code}, {nbytes} reason bytes: expected version {WIRE_VERSION}, "
                              f"a code in {sorted(CODES)}, at most {MAX_REASON} bytes")
    return code, nbytes, text_crc


def _outgoing(name: str, x: mx.array) -> mx.array:
    """The one seam every outgoing session message passes (``"preamble"``,
    ``"header"`` or a tensor's name): tests replace it to corrupt or stall a
    transfer."""
    return x


def _stored(x: mx.array) -> np.ndarray:
    """An evaluated array's bytes as numpy in its safetensors storage dtype (bf16 as
    its uint16 bits), as a session file's reader hands them to ``tensor_digests``."""
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.asarray(x)


# -- sending ----------------------------------------------------------------------------


def send_session(cache: Union[Sequence[Any], SessionSnapshot], dst: int, group: Any, *,
                 metadata: Optional[Mapping[str, Any]] = None, model: Any = None,
                 timeout: float = DEFAULT_TIMEOUT,
                 wait: Optional[float] = None) -> SentSession:
    """Hand a session (a live cache list, or a snapshot) to rank ``dst`` of ``group``,
    which takes it with ``recv_session``; returns once the receiver has installed it.

    The session is cut as ``save_session`` cuts it (the rows are copied now: the
    cache may be reused as soon as this returns) and carries ``metadata``
    (string keys, JSON values) and the fingerprint of ``model``, else of the
    model the list was built for. Waits at most ``wait`` seconds for the
    receiver to take the session (its answer to the header; None: until it does
    or the connection is lost) and ``timeout`` seconds for each later message.
    Raises ``HandoffRefused`` when the receiver refuses it (its reason
    included; the link stays usable), ``PeerLost``, ``HandoffTimeout`` or
    ``LinkBroken``."""
    timeout = _timeout(timeout, "timeout", allow_none=False)
    wait = _timeout(wait, "wait", allow_none=True)
    link = _link(group, dst, "send_session")
    user = snapshot.user_metadata(metadata)
    if isinstance(cache, SessionSnapshot):
        cut = cache if model is None else SessionSnapshot(
            cache.geometry, cache.position, cache.encoding, cache.layers, model_fingerprint(model))
    else:
        cut = SessionSnapshot.capture(cache, model)
    cut.check(cut.geometry)
    arrays = snapshot.session_arrays(cut)
    header = snapshot.session_header(cut, arrays, user)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    with link.lock, _guarded(link):
        link.post_send(_outgoing("preamble", _bytes_array(_preamble(len(raw)))))
        link.post_send(_outgoing("header", _bytes_array(raw)))
        link.drain(timeout, "the header to be taken")
        _await_verdict(link, wait, timeout, "the answer to the header")
        sent = 0
        for i, layer in enumerate(cut.layers):
            for name, x in zip(snapshot.tensor_names(i), (layer.keys, layer.values)):
                if x.size:
                    link.post_send(_outgoing(name, x))
                    sent += x.nbytes
        link.drain(timeout, "the session's tensors to be taken")
        _await_verdict(link, timeout, timeout, "the answer to the tensors")
    return SentSession(cut.position, sent, len(raw))


def _await_verdict(link: _Link, wait: Optional[float], timeout: float, what: str) -> None:
    """Take the receiver's verdict (its head within ``wait``, its reason within
    ``timeout``); raise ``HandoffRefused`` on a refusal (the link stays in step)
    or ``StreamOutOfStep`` (the link breaks)."""
    link.post_recv((VERDICT.size,), mx.uint8)
    try:
        code, nbytes, text_crc = _read_verdict(_array_bytes(link.take(wait, what)), link.peer)
        reason = ""
        if nbytes:
            link.post_recv((nbytes,), mx.uint8)
            text = _array_bytes(link.take(timeout, f"{what} (its reason)"))
            if zlib.crc32(text) != text_crc:
                raise StreamOutOfStep(f"rank {link.peer} sent a verdict whose reason fails "
                                      "its CRC32")
            reason = text.decode("utf-8", "replace")
    except StreamOutOfStep as e:
        link.fail(str(e))
        raise
    if code == OUT_OF_STEP:
        link.fail(f"rank {link.peer} found the stream out of step")
        raise StreamOutOfStep(f"rank {link.peer} found the stream out of step: {reason}")
    if code == REFUSED:
        raise HandoffRefused(link.peer, reason)


# -- receiving ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """Where a received session goes: its KV geometry and the planes' encoding."""

    geometry: MuseGeometry
    encoding: str
    plane_dtype: Any


def recv_session(model: Any, src: int, group: Any, *, into: Optional[Sequence[Any]] = None,
                 plane_dtype: DtypeLike = None, allow_other_model: bool = False,
                 timeout: float = DEFAULT_TIMEOUT,
                 wait: Optional[float] = None) -> ReceivedSession:
    """Take the session rank ``src`` sends with ``send_session`` and install it, bit
    for bit (rings at their live rotation), into a new cache list for ``model``
    (``max_context`` and planes as ``load_session`` makes them: the session's
    context, planes of the model's type unless ``plane_dtype``) or into ``into``,
    an existing list for ``model`` of the session's geometry.

    Refused, with ``into`` as it was and nothing returned: a header or tensor
    that fails its checksum (``PayloadError``), another geometry
    (``SnapshotMismatch``), another encoding than the planes'
    (``EncodingMismatch``), another model by fingerprint (``ModelMismatch``,
    unless ``allow_other_model``). The sender is told why and the link carries
    the next session. Waits at most ``wait`` seconds for the session to start
    (None: until it does or the connection is lost) and ``timeout`` seconds for
    each later message; ``PeerLost``, ``HandoffTimeout``, ``StreamOutOfStep`` and
    ``LinkBroken`` leave ``into`` as it was too, and the link broken."""
    timeout = _timeout(timeout, "timeout", allow_none=False)
    wait = _timeout(wait, "wait", allow_none=True)
    link = _link(group, src, "recv_session")
    if into is not None and plane_dtype is not None:
        raise ValueError("recv_session: plane_dtype applies to a new cache; into= has its own planes")
    if getattr(model, "args", None) is None:
        raise TypeError(f"recv_session needs an mlx-lm model with .args, got {type(model).__name__}")
    into_target = _into_target(into, model) if into is not None else None
    source = f"from rank {src}"
    with link.lock, _guarded(link):
        link.post_recv((PREAMBLE.size,), mx.uint8)
        fingerprint = None if allow_other_model else model_fingerprint(model)  # while it comes
        raw = _array_bytes(link.take(wait, "a session preamble"))
        try:
            header_nbytes = _read_preamble(raw, src)
        except StreamOutOfStep as e:
            link.fail(str(e))
            _refuse(link, OUT_OF_STEP, e, timeout)
            raise
        link.post_recv((header_nbytes,), mx.uint8)
        raw = _array_bytes(link.take(timeout, "the session header"))
        try:
            header = _parse(raw, source)
            target = into_target or _new_target(header, model, plane_dtype, source)
            _gate(header, target, fingerprint, source)
        except Exception as e:  # refused: the sender is told, the link stays in step
            _refuse(link, REFUSED, e, timeout)
            raise
        _accept(link, timeout)
        return _receive_tensors(link, header, target, model, into, timeout, source)


class _guarded:
    """Checks the link is usable on entry; on an exception that leaves a transfer
    of the link in flight (an interrupt, an error of ours), breaks it: what
    that transfer will take or give is no longer known to anyone."""

    def __init__(self, link: _Link):
        self.link = link

    def __enter__(self) -> None:
        self.link.check()

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if kind is not None and self.link.broken is None and self.link.pending:
            self.link.fail(f"{kind.__name__} with a transfer in flight")


def _into_target(into: Sequence[Any], model: Any) -> _Target:
    geometry = snapshot.cache_geometry(into)
    try:
        snapshot.check_geometry(geometry, snapshot.kv_geometry(
            MuseGeometry.from_model_args(model.args, geometry.max_context)))
    except SnapshotMismatch as e:
        raise SnapshotMismatch(f"into: {e.field} (expected: the model's; got: the cache list's)",
                               e.expected, e.got) from None
    return _Target(geometry, snapshot.plane_encoding(into[0].dtype), into[0].dtype)


def _new_target(header: snapshot.SessionHeader, model: Any, plane_dtype: DtypeLike,
                source: str) -> _Target:
    args = model.args
    context = header.geometry.max_context
    limit = MuseGeometry.from_model_args(args).max_context
    if context > limit:
        raise SnapshotMismatch(f"geometry.max_context (expected: within the model's "
                               f"max_position_embeddings; got: the session {source})",
                               f"<= {limit}", context)
    dtype = plane_dtype_for(model, plane_dtype)
    return _Target(snapshot.kv_geometry(MuseGeometry.from_model_args(args, context)),
                   snapshot.plane_encoding(dtype), dtype)


def _parse(raw: bytes, source: str) -> snapshot.SessionHeader:
    """``parse_header``'s reading of the header's fields (its checksum first)."""
    try:
        metadata = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PayloadError(source, f"header is not ASCII JSON ({type(e).__name__})") from None
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise PayloadError(source, "header expected a JSON object of strings, got "
                                   f"{tensorfile.show(metadata)}")
    try:
        return snapshot.parse_header(metadata, source)
    except SessionFileError as e:
        raise PayloadError(source, e.problem) from None


def _gate(header: snapshot.SessionHeader, target: _Target, fingerprint: Optional[Dict[str, str]],
          source: str) -> None:
    """Everything about the session that its header settles, before any tensor:
    geometry, model, encoding, the starts and the tensor set."""
    try:
        snapshot.check_geometry(header.geometry, target.geometry)
    except SnapshotMismatch as e:
        raise SnapshotMismatch(f"{e.field} (expected: the receiver's; got: the session {source})",
                               e.expected, e.got) from None
    if fingerprint is not None:
        snapshot.check_model(header.model, fingerprint, "the receiving model")
    if header.encoding != target.encoding:
        raise (ProductionF16Required(header.encoding) if target.encoding == snapshot.F16LE
               else EncodingMismatch(header.encoding, target.encoding))
    geometry = header.geometry
    if not 0 <= header.position <= geometry.max_context:
        raise SnapshotMismatch("position", f"an int in [0, {geometry.max_context}]",
                               header.position)
    for i, start in enumerate(header.starts):
        expected = snapshot.expected_cut(geometry, i, header.position)[0]
        if start != expected:
            raise SnapshotMismatch("start", expected, start, i, geometry.layer_kind(i))
    names = set(header.tensor_names)
    if set(header.checksums) != names:
        missing = sorted(names - set(header.checksums))
        extra = sorted(set(header.checksums) - names)
        raise PayloadError(source, f"checksums expected one per tensor of the geometry; "
                                   f"missing {missing}, unexpected {tensorfile.show(extra)}")


def _receive_tensors(link: _Link, header: snapshot.SessionHeader, target: _Target, model: Any,
                     into: Optional[Sequence[Any]], timeout: float,
                     source: str) -> ReceivedSession:
    """Post every tensor's receive, then verify and install the layers as they
    arrive: at least the next one, with every later one whose tensors are in
    already (one ``tensor_digests`` call, hashing them side by side). On a
    refusal take the rest of the stream, undo, and answer the verdict."""
    geometry = header.geometry
    dtype = ENCODINGS[header.encoding][0]
    shapes = [(snapshot.expected_cut(geometry, i, header.position)[1], geometry.kv_heads,
               geometry.head_dim) for i in range(geometry.num_layers)]
    for shape in shapes:
        if shape[0]:
            link.post_recv(shape, dtype)
            link.post_recv(shape, dtype)
    held: List[Any] = []
    cuts: List[LayerCut] = []
    refusal: Optional[Exception] = None
    nbytes = 0
    cache: Sequence[Any] = []
    try:
        try:
            cache = into if into is not None else make_prompt_cache(
                model, geometry.max_context, plane_dtype=target.plane_dtype)
        except Exception as e:
            refusal = e
        i = 0
        while i < len(shapes):
            batch: Dict[int, List[mx.array]] = {}
            while i < len(shapes) and (not batch or link.arrived() >= (2 if shapes[i][0] else 0)):
                batch[i] = _take_layer(link, i, shapes[i], dtype, timeout)
                i += 1
            if refusal is not None:
                continue  # taking the rest of the stream, to stay in step
            try:
                nbytes += _install_batch(cache, header, batch, held, source)
                cuts.extend(LayerCut(header.starts[j], *pair) for j, pair in batch.items())
            except Exception as e:
                refusal = e
        if refusal is None:
            try:
                SessionSnapshot(geometry, header.position, header.encoding, tuple(cuts),
                                header.model).check(target.geometry)
            except Exception as e:
                refusal = e
    except BaseException:
        _undo(held)
        raise
    if refusal is not None:
        _undo(held)
        _refuse(link, REFUSED, refusal, timeout)
        raise refusal
    try:
        _accept(link, timeout)
    except BaseException:
        _undo(held)
        raise
    return ReceivedSession(cache, header.user, header.position, nbytes)


def _take_layer(link: _Link, i: int, shape: Tuple[int, int, int], dtype: Any,
                timeout: float) -> List[mx.array]:
    """Layer ``i``'s keys and values as they came (an empty layer sends nothing)."""
    if not shape[0]:
        return [mx.zeros(shape, dtype), mx.zeros(shape, dtype)]
    return [link.take(timeout, f"{n} ({shape[0]} rows)") for n in snapshot.tensor_names(i)]


def _install_batch(cache: Sequence[Any], header: snapshot.SessionHeader,
                   batch: Mapping[int, List[mx.array]], held: List[Any], source: str) -> int:
    """Check the batch's tensors against their digests, then install each layer
    (``held`` gets what puts it back); returns the bytes installed."""
    named = {n: x for i, pair in batch.items() for n, x in zip(snapshot.tensor_names(i), pair)}
    digests = snapshot.tensor_digests({n: _stored(x) for n, x in named.items()})
    for n in named:
        if digests[n] != header.checksums[n]:
            raise PayloadError(source, f"corrupted tensor {n!r} (checksum mismatch): sha256 "
                                       f"expected {header.checksums[n]}, got {digests[n]}")
    for i, (keys, values) in batch.items():
        layer = cache[i]
        held.append((layer, layer.hold()))
        layer.install(header.starts[i], keys, values)
        mx.eval(layer.kv_state)
    return sum(x.nbytes for x in named.values())


def _undo(held: List[Any]) -> None:
    for layer, state in reversed(held):
        layer.release(state)
    held.clear()


def _answer(link: _Link, code: int, reason: str, timeout: float) -> None:
    head, text = _verdict(code, reason)
    link.post_send(_bytes_array(head))
    if text:
        link.post_send(_bytes_array(text))
    link.drain(timeout, "the verdict to be taken")


def _accept(link: _Link, timeout: float) -> None:
    _answer(link, ACCEPTED, "", timeout)


def _refuse(link: _Link, code: int, error: BaseException, timeout: float) -> None:
    """Tell the sender why; a link failure while telling it is not this error's."""
    try:
        _answer(link, code, f"{type(error).__name__}: {error}", timeout)
    except HandoffError:
        pass


