"""Sessions handed between processes over MLX's distributed layer: prefill
here, decode there.

``send_session(cache, dst, group)`` cuts a live cache list and streams it to
rank ``dst``; ``recv_session(model, src, group)`` installs it, bit for bit, into
a new cache list for ``model`` (or into ``into=``, an existing one). Transfers
are ``mx.distributed.send`` / ``recv`` on ``group`` (the ring backend over TCP
here; MPI and JACCL groups take the same calls), or, with
``transport="collective"`` (what ``"auto"`` picks in a process launched for
MLX's NCCL backend, which has no send/recv), collectives on a group of two
ranks that carry the same messages (``muser_kv.sessions.wire``).

Invariants:

* **What travels is a session file's content.** The header is the one
  ``save_session`` writes (``save.session_header`` builds both: format, version,
  geometry, position, encoding, starts, per-tensor digests, user metadata, model
  fingerprint, ``header_sha256``), and the tensors are the file's, in layer
  order. The receiver checks it with the sessions layer's own functions
  (``parse_header``, ``tensor_digests``, and the one restore path's gate and
  install loop, ``muser_kv.sessions.restore``, that loads and store rebuilds
  take), so a change there applies here unchanged.
* **Nothing from the wire is trusted before it is verified.** The header
  checksum is checked before any field is read; geometry, position, model
  fingerprint, encoding and every layer's start before a tensor is accepted
  (each once); every tensor's shape and dtype come
  from the verified header, never from the wire, and its bytes must match the
  header's digest before its layer is installed.
* **Streamed, all or nothing.** Layer ``i`` is installed (at rotation ``start
  % capacity``, by the restore path's ``Install``) as soon as its keys and
  values have arrived and matched their digests, while later layers are still
  in flight. The cache is handed back only when every layer is in; on any
  refusal or failure a new cache is dropped, and ``into`` gets every layer's
  planes and ring back as they were.
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
* ``"p2p"`` transfers run on a CPU stream (ring, MPI and JACCL groups transfer
  from the CPU); ``"collective"`` ones on the stream the backend picks (a GPU
  stream for NCCL: not run here, only the ring backend's collectives are).
* The header, its per-tensor digests included, is built before the first
  byte goes out: the sender hashes the whole session first, as a save does.

The wire itself: ``muser_kv.sessions.wire``.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx

from muser_kv.caches.factory import make_prompt_cache
from muser_kv.core.geometry import MuseGeometry, context_limit
from muser_kv.core.precision import DtypeLike, plane_dtype_for
from muser_kv.sessions import format as fmt
from muser_kv.sessions import restore, save, tensorfile, wire
from muser_kv.sessions.fingerprint import model_fingerprint
from muser_kv.sessions.format import ENCODINGS, SessionFileError, SnapshotMismatch
from muser_kv.sessions.snapshot import SessionSnapshot
from muser_kv.sessions.wire import (  # the errors are handoff's API too
    ACCEPTED,
    DEFAULT_TIMEOUT,
    OUT_OF_STEP,
    PREAMBLE,
    REFUSED,
    VERDICT,
    HandoffError,
    HandoffRefused,
    HandoffTimeout,
    Link,
    LinkBroken,
    PayloadError,
    PeerLost,
    ReceivedSession,
    SentSession,
    StreamOutOfStep,
)

#: What callers of the handoff use: the two calls, their results and errors.
__all__ = ["DEFAULT_TIMEOUT", "HandoffError", "HandoffRefused", "HandoffTimeout", "LinkBroken",
           "PayloadError", "PeerLost", "ReceivedSession", "SentSession", "StreamOutOfStep",
           "recv_session", "send_session"]


# -- sending ----------------------------------------------------------------------------


def send_session(cache: Union[Sequence[Any], SessionSnapshot], dst: int, group: Any, *,
                 metadata: Optional[Mapping[str, Any]] = None, model: Any = None,
                 timeout: float = DEFAULT_TIMEOUT,
                 wait: Optional[float] = None, transport: str = "auto") -> SentSession:
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
    ``LinkBroken``.

    ``transport`` (the receiver's must be the same): ``"p2p"``, one
    ``mx.distributed.send`` / ``recv`` per message; ``"collective"``, the same
    messages as ``all_gather`` / ``all_sum`` on a group of exactly 2 ranks (for
    MLX's NCCL backend, which has no send/recv); ``"auto"``, ``"collective"``
    when CUDA is available and ``NCCL_HOST_IP``, ``NCCL_PORT`` and
    ``MLX_WORLD_SIZE`` are set (a process ``mlx.launch --backend nccl``
    started), else ``"p2p"``: an MLX group does not tell its backend. One
    (group, peer) pair keeps the transport of its first call."""
    timeout = wire.seconds(timeout, "timeout", allow_none=False)
    wait = wire.seconds(wait, "wait", allow_none=True)
    link = wire.link(group, dst, "send_session", transport)
    user = save.user_metadata(metadata)
    if isinstance(cache, SessionSnapshot):
        cut = cache if model is None else SessionSnapshot(
            cache.geometry, cache.position, cache.encoding, cache.layers, model_fingerprint(model))
    else:
        cut = SessionSnapshot.capture(cache, model)
    cut.check(cut.geometry)
    arrays = save.session_arrays(cut)
    header = save.session_header(cut, arrays, user)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    with link.lock, _guarded(link):
        link.post_send(wire.outgoing("preamble", wire.bytes_array(wire.preamble(len(raw)))))
        link.post_send(wire.outgoing("header", wire.bytes_array(raw)))
        link.drain(timeout, "the header to be taken")
        _await_verdict(link, wait, timeout, "the answer to the header")
        sent = 0
        for i, layer in enumerate(cut.layers):
            for name, x in zip(fmt.tensor_names(i), (layer.keys, layer.values)):
                if x.size:
                    link.post_send(wire.outgoing(name, x))
                    sent += x.nbytes
        link.drain(timeout, "the session's tensors to be taken")
        _await_verdict(link, timeout, timeout, "the answer to the tensors")
    return SentSession(cut.position, sent, len(raw))


def _await_verdict(link: Link, wait: Optional[float], timeout: float, what: str) -> None:
    """Take the receiver's verdict (its head within ``wait``, its reason within
    ``timeout``); raise ``HandoffRefused`` on a refusal (the link stays in step)
    or ``StreamOutOfStep`` (the link breaks)."""
    link.post_recv((VERDICT.size,), mx.uint8)
    try:
        code, nbytes, text_crc = wire.read_verdict(wire.array_bytes(link.take(wait, what)), link.peer)
        reason = ""
        if nbytes:
            link.post_recv((nbytes,), mx.uint8)
            text = wire.array_bytes(link.take(timeout, f"{what} (its reason)"))
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
class _Where:
    """Where a received session goes: the list's KV geometry, its planes'
    encoding and dtype (``Target`` once the model's fingerprint is known)."""

    geometry: MuseGeometry
    encoding: str
    plane_dtype: Any


def recv_session(model: Any, src: int, group: Any, *, into: Optional[Sequence[Any]] = None,
                 plane_dtype: DtypeLike = None, allow_other_model: bool = False,
                 timeout: float = DEFAULT_TIMEOUT, wait: Optional[float] = None,
                 transport: str = "auto") -> ReceivedSession:
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
    ``LinkBroken`` leave ``into`` as it was too, and the link broken.
    ``transport``: as ``send_session``'s, and the sender's must be the same."""
    timeout = wire.seconds(timeout, "timeout", allow_none=False)
    wait = wire.seconds(wait, "wait", allow_none=True)
    link = wire.link(group, src, "recv_session", transport)
    if into is not None and plane_dtype is not None:
        raise ValueError("recv_session: plane_dtype applies to a new cache; into= has its own planes")
    if getattr(model, "args", None) is None:
        raise TypeError(f"recv_session needs an mlx-lm model with .args, got {type(model).__name__}")
    into_target = _into_target(into, model) if into is not None else None
    source = f"from rank {src}"
    with link.lock, _guarded(link):
        link.post_recv((PREAMBLE.size,), mx.uint8)
        fingerprint = None if allow_other_model else model_fingerprint(model)  # while it comes
        raw = wire.array_bytes(link.take(wait, "a session preamble"))
        try:
            header_nbytes = wire.read_preamble(raw, src)
        except StreamOutOfStep as e:
            link.fail(str(e))
            _refuse(link, OUT_OF_STEP, e, timeout)
            raise
        link.post_recv((header_nbytes,), mx.uint8)
        raw = wire.array_bytes(link.take(timeout, "the session header"))
        try:
            header = _parse(raw, source)
            where = into_target or _new_target(header, model, plane_dtype, source)
            target = restore.Target(where.geometry, where.encoding, fingerprint,
                                    "the receiving model")
            _gate(header, target, source)
        except Exception as e:  # refused: the sender is told, the link stays in step
            _refuse(link, REFUSED, e, timeout)
            raise
        _accept(link, timeout)
        return _receive_tensors(link, header, where, model, into, timeout, source)


class _guarded:
    """Checks the link is usable on entry; on an exception that leaves a transfer
    of the link in flight (an interrupt, an error of ours), breaks it: what
    that transfer will take or give is no longer known to anyone."""

    def __init__(self, link: Link):
        self.link = link

    def __enter__(self) -> None:
        self.link.check()

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if kind is not None and self.link.broken is None and self.link.pending:
            self.link.fail(f"{kind.__name__} with a transfer in flight")


def _into_target(into: Sequence[Any], model: Any) -> _Where:
    geometry = restore.cache_geometry(into)
    try:
        model_geometry = MuseGeometry.from_model(model, geometry.max_context)
        restore.check_geometry(geometry, restore.kv_geometry(model_geometry))
    except SnapshotMismatch as e:
        raise SnapshotMismatch(f"into: {e.field} (expected: the model's; got: the cache list's)",
                               e.expected, e.got) from None
    return _Where(geometry, fmt.plane_encoding(into[0].dtype), into[0].dtype)


def _new_target(header: fmt.SessionHeader, model: Any, plane_dtype: DtypeLike,
                source: str) -> _Where:
    context = header.geometry.max_context
    limit = context_limit(model)
    if limit is not None and context > limit:
        raise SnapshotMismatch(f"geometry.max_context (expected: within the model's "
                               f"max_position_embeddings; got: the session {source})",
                               f"<= {limit}", context)
    dtype = plane_dtype_for(model, plane_dtype)
    return _Where(restore.kv_geometry(MuseGeometry.from_model(model, context)),
                  fmt.plane_encoding(dtype), dtype)


def _parse(raw: bytes, source: str) -> fmt.SessionHeader:
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
        return fmt.parse_header(metadata, source)
    except SessionFileError as e:
        raise PayloadError(source, e.problem) from None


def _gate(header: fmt.SessionHeader, target: restore.Target, source: str) -> None:
    """Everything about the session that its header settles, before any tensor:
    the restore gate (geometry, position, model, encoding), every layer's start,
    and the tensor set."""
    restore.check_session(target, header.geometry, header.position, header.encoding, header.model,
                  whose=("the receiver's", f"the session {source}"))
    for i, start in enumerate(header.starts):
        restore.check_start(header.geometry, header.position, i, start)
    names = set(header.tensor_names)
    if set(header.checksums) != names:
        missing = sorted(names - set(header.checksums))
        extra = sorted(set(header.checksums) - names)
        raise PayloadError(source, f"checksums expected one per tensor of the geometry; "
                                   f"missing {missing}, unexpected {tensorfile.show(extra)}")


def _receive_tensors(link: Link, header: fmt.SessionHeader, where: _Where, model: Any,
                     into: Optional[Sequence[Any]], timeout: float,
                     source: str) -> ReceivedSession:
    """Post every tensor's receive, then verify and install the layers as they
    arrive: at least the next one, with every later one whose tensors are in
    already (one ``tensor_digests`` call, hashing them side by side). Each
    tensor's shape and dtype are the gated header's, so a layer whose digests
    match is what the gate passed. On a refusal take the rest of the stream,
    undo, and answer the verdict."""
    geometry = header.geometry
    dtype = ENCODINGS[header.encoding][0]
    shapes = [(restore.expected_cut(geometry, i, header.position)[1], *geometry.layer_dims(i))
              for i in range(geometry.num_layers)]
    for shape in shapes:
        if shape[0]:
            link.post_recv(shape, dtype)
            link.post_recv(shape, dtype)
    install: Optional[restore.Install] = None
    refusal: Optional[Exception] = None
    nbytes = 0
    try:
        try:
            cache = into if into is not None else make_prompt_cache(
                model, geometry.max_context, plane_dtype=where.plane_dtype)
            install = restore.Install(cache, rollback=True)
        except Exception as e:
            refusal = e
        i = 0
        while i < len(shapes):
            batch: Dict[int, List[mx.array]] = {}
            while i < len(shapes) and (not batch or link.arrived() >= (2 if shapes[i][0] else 0)):
                batch[i] = _take_layer(link, i, shapes[i], dtype, timeout)
                i += 1
            if refusal is not None or install is None:  # install: made, or a refusal
                continue  # taking the rest of the stream, to stay in step
            try:
                nbytes += _install_batch(install, header, batch, source)
            except Exception as e:
                refusal = e
        if refusal is None and install is not None:
            try:
                install.finish()
            except Exception as e:
                refusal = e
    except BaseException:
        if install is not None:
            install.undo()
        raise
    if refusal is not None:
        if install is not None:
            install.undo()
        _refuse(link, REFUSED, refusal, timeout)
        raise refusal
    assert install is not None  # made, or the refusal above
    try:
        _accept(link, timeout)
    except BaseException:
        install.undo()
        raise
    return ReceivedSession(install.cache, header.user, header.position, nbytes)


def _take_layer(link: Link, i: int, shape: Tuple[int, int, int], dtype: Any,
                timeout: float) -> List[mx.array]:
    """Layer ``i``'s keys and values as they came (an empty layer sends nothing)."""
    if not shape[0]:
        return [mx.zeros(shape, dtype), mx.zeros(shape, dtype)]
    return [link.take(timeout, f"{n} ({shape[0]} rows)") for n in fmt.tensor_names(i)]


def _install_batch(install: restore.Install, header: fmt.SessionHeader,
                   batch: Mapping[int, List[mx.array]], source: str) -> int:
    """Check the batch's tensors against their digests, then install each layer
    through the restore path's loop; returns the bytes installed."""
    named = {n: x for i, pair in batch.items() for n, x in zip(fmt.tensor_names(i), pair)}
    digests = fmt.tensor_digests({n: fmt.stored_view(x) for n, x in named.items()})
    for n in named:
        if digests[n] != header.checksums[n]:
            raise PayloadError(source, f"corrupted tensor {n!r} (checksum mismatch): sha256 "
                                       f"expected {header.checksums[n]}, got {digests[n]}")
    for i, (keys, values) in batch.items():
        install.layer(i, header.starts[i], keys, values)
    return sum(x.nbytes for x in named.values())


def _answer(link: Link, code: int, reason: str, timeout: float) -> None:
    head, text = wire.verdict(code, reason)
    link.post_send(wire.bytes_array(head))
    if text:
        link.post_send(wire.bytes_array(text))
    link.drain(timeout, "the verdict to be taken")


def _accept(link: Link, timeout: float) -> None:
    _answer(link, ACCEPTED, "", timeout)


def _refuse(link: Link, code: int, error: BaseException, timeout: float) -> None:
    """Tell the sender why; a link failure while telling it is not this error's."""
    try:
        _answer(link, code, f"{type(error).__name__}: {error}", timeout)
    except HandoffError:
        pass


