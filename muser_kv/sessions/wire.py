"""The handoff's wire: framing, verdicts, errors, and the link (one courier
thread per (group, peer), running its transfers in order). ``handoff`` runs
the protocol over these; every outgoing message passes ``outgoing``.

Wire, per session (sender S, receiver R; all integers little-endian):
S->R preamble (``PREAMBLE``: magic, wire version, header length, CRC32), S->R
the header (compact ASCII JSON of the header fields), R->S verdict (``VERDICT``
+ reason text), S->R every non-empty tensor (``layers.{i}.keys``, then
``.values``, ``i`` ascending, as ``[rows, kv_heads, head_dim]`` of the
encoding's dtype), R->S verdict. The CRCs only frame the stream; the session's
integrity is the header's own checksum and digests.

Transports, per link: ``"p2p"`` carries each message as one
``mx.distributed.send`` / ``recv``. ``"collective"`` carries it on a group of
exactly two ranks, for backends with collectives but no send/recv (MLX's
NCCL), each message as two ``all_sum`` of uint8 bytes (integer addition of
zeros: exact): first both ranks' ``DESCRIPTOR`` (role, payload bytes), each
rank's in its own slot, zeros in the other's; then, only when one rank sends
and the other receives the same number of bytes, the payload (the sender's
bytes plus the receiver's zeros). A collective whose ranks disagree on its
size is undefined in the backends (NCCL may hang or read past a buffer), so a
disagreement is settled by the fixed-size descriptor alone: both ranks raise
``StreamOutOfStep`` and have issued the same collectives. A live peer in step
never contributes an empty descriptor, and the ring backend's collectives can
complete without error when the peer is gone, its part left zeros: an empty
descriptor is ``PeerLost``.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional, Sequence, Tuple, overload

import mlx.core as mx
import numpy as np

from muser_kv.sessions import tensorfile
from muser_kv.sessions.format import (
    SessionFileError,
    SnapshotError,
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
#: collective transport, per message: role, reserved, payload bytes (summed in rank slots)
DESCRIPTOR = struct.Struct("<B7xQ")
SENDS, RECEIVES = 1, 2
TRANSPORTS = ("auto", "p2p", "collective")
#: What MLX's NCCL backend reads at init, and ``mlx.launch --backend nccl`` sets.
NCCL_ENV = ("NCCL_HOST_IP", "NCCL_PORT", "MLX_WORLD_SIZE")


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
    """A daemon thread that runs one link's transfers in submission order and
    posts each result (an evaluated array, or the exception MLX raised) to the
    queue the submitter waits on. ``"p2p"`` transfers run on the thread's own
    CPU stream; ``"collective"`` ones on the stream the group's backend picks
    for this thread (a GPU stream for NCCL, a CPU stream for ring and MPI)."""

    def __init__(self, name: str, transport: str):
        self.transport = transport
        self._jobs: "queue.SimpleQueue[Tuple[Any, ...]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream = mx.new_stream(mx.cpu)
        while True:
            op, args, group, done = self._jobs.get()
            try:
                if self.transport == "collective":
                    done.put(("ok", _exchange(op, args, group)))
                elif op == "send":
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


def _exchange(op: str, args: Tuple[Any, ...], group: Any) -> Optional[mx.array]:
    """One message over a 2-rank group's collectives: the descriptors, then (when
    they agree) the payload's bytes summed with the receiver's zeros."""
    received: Optional[Tuple[Tuple[int, ...], Any]] = None  # its shape and dtype
    if op == "send":
        (x, peer) = args
        role, payload = SENDS, x.reshape(-1).view(mx.uint8)
    else:
        (shape, dtype, peer) = args
        received = (shape, dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.size
        role, payload = RECEIVES, mx.zeros((size,), mx.uint8)
    nbytes = payload.size
    slots = bytearray(2 * DESCRIPTOR.size)
    DESCRIPTOR.pack_into(slots, DESCRIPTOR.size * (1 - peer), role, nbytes)
    both = array_bytes(mx.distributed.all_sum(bytes_array(bytes(slots)), group=group))
    theirs = both[DESCRIPTOR.size * peer:DESCRIPTOR.size * (peer + 1)]
    their_role, their_nbytes = DESCRIPTOR.unpack(theirs)
    if not any(theirs):
        raise PeerLost("its part of the message's descriptor came as zeros: it took no part")
    if their_role != SENDS + RECEIVES - role or their_nbytes != nbytes:
        doing = {SENDS: "sends", RECEIVES: "receives"}
        raise StreamOutOfStep(
            f"rank {peer} {doing.get(their_role, f'(role {their_role})')} a message of "
            f"{their_nbytes} bytes where this rank {doing[role]} one of {nbytes}: the ranks "
            "are out of step")
    y = mx.distributed.all_sum(payload, group=group)
    if received is None:
        mx.eval(y)
        return None
    y = y.view(received[1]).reshape(received[0])
    mx.eval(y)
    return y


class Link:
    """One (group, peer) pair: its transport, courier, lock, and whether it is broken."""

    def __init__(self, group: Any, peer: int, transport: str):
        self.group = group  # held: the registry's key is id(group)
        self.peer = peer
        self.transport = transport
        self.courier = _Courier(f"muser-kv handoff rank {group.rank()}<->{peer}", transport)
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
            if isinstance(value, PeerLost) or (isinstance(value, RuntimeError) and
                                               "connection to a peer was lost" in str(value)):
                self.broken = f"connection lost during {what}"
                raise PeerLost(f"rank {self.peer} went away during {what} ({value})") from None
            self.broken = f"{type(value).__name__} during {what}"
            if isinstance(value, StreamOutOfStep):
                raise StreamOutOfStep(f"{value} (during {what})") from None
            hint = ""
            if self.transport == "p2p" and ("NCCL" in str(value) or "CUDA" in str(value)):
                hint = " (a backend without send/recv, such as NCCL: pass transport='collective')"
            raise HandoffError(f"transfer of {what} with rank {self.peer} failed: "
                               f"{type(value).__name__}: {value}{hint}") from value
        return value

    def arrived(self) -> int:
        """Posted transfers that have completed and wait to be taken."""
        return self._done.qsize()

    def drain(self, timeout: float, what: str) -> None:
        while self.pending:
            self.take(timeout, what)

    def fail(self, why: str) -> None:
        self.broken = why


_LINKS: Dict[Tuple[int, int], Link] = {}
_LINKS_LOCK = threading.Lock()


def link(group: Any, peer: Any, role: str, transport: Any = "auto") -> Link:
    """The process's one link with rank ``peer`` of ``group`` (made on first
    use), after checking both; ``role`` names the caller in a refusal."""
    if group is None or not hasattr(group, "rank"):
        raise TypeError(f"{role} needs an mx.distributed group, got {type(group).__name__}")
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise TypeError(f"{role}: peer rank must be an int, got {type(peer).__name__}")
    rank, size = group.rank(), group.size()
    if not 0 <= peer < size or peer == rank:
        raise ValueError(f"{role}: peer rank expected another rank of the group "
                         f"(0..{size - 1}, not {rank}), got {peer}")
    carrier = _transport(transport, role)
    if carrier == "collective" and size != 2:
        raise ValueError(f"{role}: the collective transport expected a group of 2 ranks (every "
                         f"rank of a group takes part in each collective), got {size}; make "
                         "one of the two ranks with group.split")
    with _LINKS_LOCK:
        found = _LINKS.get((id(group), peer))
        if found is None or found.group is not group:
            found = Link(group, peer, carrier)
            _LINKS[(id(group), peer)] = found
    if found.transport != carrier:
        raise ValueError(f"{role}: the handoff link with rank {peer} carries the "
                         f"{found.transport!r} transport, got {carrier!r} (one transport per "
                         "group and peer)")
    return found


def _transport(transport: Any, role: str) -> str:
    """``transport`` resolved: ``"auto"`` is ``"collective"`` where MLX's NCCL
    backend is what this process was launched for (CUDA available and the
    variables NCCL's init reads all set: ``mlx.launch --backend nccl`` sets
    them, and ``mx.distributed.init()`` then makes an NCCL group), else
    ``"p2p"``. An ``mx.distributed.Group`` does not tell its backend."""
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise ValueError(f"{role}: transport expected one of {list(TRANSPORTS)}, "
                         f"got {transport!r}")
    if transport != "auto":
        return transport
    nccl = mx.cuda.is_available() and all(os.environ.get(v) for v in NCCL_ENV)
    return "collective" if nccl else "p2p"


@overload
def seconds(value: Optional[float], name: str, allow_none: Literal[False]) -> float: ...


@overload
def seconds(value: Optional[float], name: str, allow_none: bool) -> Optional[float]: ...


def seconds(value: Optional[float], name: str, allow_none: bool) -> Optional[float]:
    """A caller's bound ``name`` as a positive float (or None, where allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} expected a positive number of seconds"
                         f"{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


# -- framing ---------------------------------------------------------------------------


def bytes_array(data: bytes) -> mx.array:
    """``data`` as the ``uint8`` array a message carries."""
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def array_bytes(x: mx.array) -> bytes:
    """A received ``uint8`` message's bytes."""
    return np.asarray(x).tobytes()


def preamble(header_nbytes: int) -> bytes:
    """The preamble announcing a header of ``header_nbytes``."""
    fields = PREAMBLE.pack(PREAMBLE_MAGIC, WIRE_VERSION, 0, header_nbytes, 0)[:-4]
    return fields + struct.pack("<I", zlib.crc32(fields))


def read_preamble(raw: bytes, peer: int) -> int:
    """The header length a preamble from ``peer`` announces (``StreamOutOfStep``
    for anything that is not this protocol's preamble)."""
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


def verdict(code: int, reason: str = "") -> Tuple[bytes, bytes]:
    """A verdict's head and its reason's bytes (cut at ``MAX_REASON``)."""
    text = reason.encode("utf-8", "replace")[:MAX_REASON]
    fields = VERDICT.pack(VERDICT_MAGIC, WIRE_VERSION, code, len(text), zlib.crc32(text), 0)[:-4]
    return fields + struct.pack("<I", zlib.crc32(fields)), text


def read_verdict(raw: bytes, peer: int) -> Tuple[int, int, int]:
    """``(code, reason bytes, reason CRC32)`` of a verdict head from ``peer``
    (``StreamOutOfStep`` for anything else)."""
    magic, version, code, nbytes, text_crc, crc = VERDICT.unpack(raw)
    if magic != VERDICT_MAGIC or crc != zlib.crc32(raw[:-4]):
        raise StreamOutOfStep(f"rank {peer} sent {magic!r}... where a verdict (magic "
                              f"{VERDICT_MAGIC!r}, CRC32-framed) was expected")
    if version != WIRE_VERSION or code not in CODES or nbytes > MAX_REASON:
        raise StreamOutOfStep(f"rank {peer} sent a verdict of wire version {version}, code "
                              f"{code}, {nbytes} reason bytes: expected version {WIRE_VERSION}, "
                              f"a code in {sorted(CODES)}, at most {MAX_REASON} bytes")
    return code, nbytes, text_crc


def outgoing(name: str, x: mx.array) -> mx.array:
    """The one seam every outgoing session message passes (``"preamble"``,
    ``"header"`` or a tensor's name): tests replace it to corrupt or stall a
    transfer."""
    return x
