"""Moving MLX CUDA's host-visible arrays to the GPU in bulk, and keeping GPU
arrays there when the host reads them.

On MLX CUDA an array made by a CPU stream lives in managed memory
(``cudaMallocManaged``): the host writes it in place, and the first GPU kernel
to read it pulls its pages over one fault at a time, at a fraction of the
link's speed. ``to_gpu`` asks the CUDA runtime to migrate a range now
(``cudaMemPrefetchAsync``) and waits for it, so a kernel launched afterwards
finds the pages already there.

The other way round, a host read of a GPU array (numpy, a file write) moves
its buffer into managed memory for good (MLX CUDA's ``Buffer::raw_ptr``), so
the next kernels to read that array fault its pages back. An array the GPU
will read again is read on the host through ``host_copies``: a copy made on
the GPU moves, the array stays.

It is a hint and never a condition of correctness: managed memory is coherent
whether the pages moved early, late or not at all, so where there is no CUDA
runtime (the CPU, Metal) or the range is not managed memory, ``to_gpu`` does
nothing and says so by returning ``False``. The runtime is the one MLX loaded
(found in the process's mappings), so its calls act on MLX's own context.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from typing import Any, List, Optional, Sequence

import mlx.core as mx
import numpy as np

#: Whether ``to_gpu`` migrates at all (off: the GPU pulls pages in as it faults on them).
ENABLED = True
#: ``cudaMemLocationTypeDevice`` and ``cudaStreamNonBlocking`` from the CUDA runtime's headers.
LOCATION_DEVICE = 1
STREAM_NON_BLOCKING = 1
#: The runtime version from which ``cudaMemPrefetchAsync`` takes a ``cudaMemLocation``
#: (before 13.0 that form is ``cudaMemPrefetchAsync_v2``, from 12.2).
LOCATION_ARGUMENT = 13000
V2_SINCE = 12020


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def loaded_runtime(maps: str = "/proc/self/maps") -> Optional[str]:
    """The path of the CUDA runtime library this process has mapped, if any."""
    try:
        with open(maps) as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


class Prefetcher:
    """``cudaMemPrefetchAsync`` to one device, each call on a non-blocking stream
    of a pool (reader threads migrate their own tensors side by side; the pool
    holds as many streams as there were calls at once, reused by every load)."""

    def __init__(self, runtime: Any, device: int):
        self._rt = runtime
        self.device = device
        version = ctypes.c_int(0)
        self._check(runtime.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = version.value
        if self.version >= LOCATION_ARGUMENT or self.version < V2_SINCE:
            self._prefetch = runtime.cudaMemPrefetchAsync
        else:
            self._prefetch = runtime.cudaMemPrefetchAsync_v2
        for name in ("cudaSetDevice", "cudaStreamCreateWithFlags", "cudaStreamSynchronize"):
            getattr(runtime, name)  # every entry point found now, or no prefetcher
        self._streams: "queue.SimpleQueue[ctypes.c_void_p]" = queue.SimpleQueue()

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            self._rt.cudaGetLastError()  # not left for MLX's own checks to find on this thread
            raise OSError(f"{what} failed with CUDA error {code}")

    def _stream(self) -> ctypes.c_void_p:
        try:
            return self._streams.get_nowait()
        except queue.Empty:
            stream = ctypes.c_void_p()
            self._check(self._rt.cudaStreamCreateWithFlags(ctypes.byref(stream),
                                                           STREAM_NON_BLOCKING),
                        "cudaStreamCreateWithFlags")
            return stream

    def prefetch(self, address: int, nbytes: int) -> None:
        """Migrate ``[address, address + nbytes)`` to the device and wait for it."""
        self._check(self._rt.cudaSetDevice(self.device), "cudaSetDevice")  # this thread's
        stream = self._stream()
        try:
            ptr, size = ctypes.c_void_p(address), ctypes.c_size_t(nbytes)
            if self.version >= V2_SINCE:
                code = self._prefetch(ptr, size, MemLocation(LOCATION_DEVICE, self.device),
                                      ctypes.c_uint(0), stream)
            else:
                code = self._prefetch(ptr, size, ctypes.c_int(self.device), stream)
            self._check(code, "cudaMemPrefetchAsync")
            self._check(self._rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        finally:
            self._streams.put(stream)


def host_reads_move() -> bool:
    """Whether a host read of a GPU array moves its buffer (module doc): on MLX
    CUDA. The CPU's arrays and Metal's unified memory stay where they are."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available()


def host_copies(arrays: Sequence[mx.array]) -> List[mx.array]:
    """What to read on the host in place of ``arrays`` that the GPU reads again:
    where host reads move buffers, copies made on the GPU (bit for bit: an
    integer OR with 0 over their bytes, which cannot reuse a buffer another
    array holds); elsewhere ``arrays`` themselves. Not evaluated."""
    if not host_reads_move():
        return list(arrays)
    return [_bitwise_copy(a) for a in arrays]


def _bitwise_copy(a: mx.array) -> mx.array:
    return (a.view(mx.uint8) | 0).view(a.dtype)


_BUILD = threading.Lock()
_UNSET = object()
_PREFETCHER: Any = _UNSET


def build() -> Optional[Prefetcher]:
    """A prefetcher on the CUDA runtime MLX loaded, for MLX's current device, or
    ``None`` where MLX runs without CUDA (raises where the runtime lacks an
    entry point: ``prefetcher`` turns that into ``None``)."""
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return None
    mx.eval(mx.zeros((1,), stream=mx.gpu))  # MLX has loaded its runtime and made its context
    path = loaded_runtime()
    if path is None:
        return None
    runtime = ctypes.CDLL(path)
    device = ctypes.c_int(0)
    if runtime.cudaGetDevice(ctypes.byref(device)) != 0:
        return None
    return Prefetcher(runtime, device.value)


def prefetcher() -> Optional[Prefetcher]:
    """The process's prefetcher, built once (``build``, by whichever thread asks
    first), or ``None`` where MLX runs without CUDA or its runtime cannot be
    used: a hint never fails a load."""
    global _PREFETCHER
    with _BUILD:
        if _PREFETCHER is _UNSET:
            try:
                _PREFETCHER = build()
            except Exception:
                _PREFETCHER = None
        return _PREFETCHER


def reset() -> None:
    """Forget the process's prefetcher: the next ``prefetcher()`` builds it again."""
    global _PREFETCHER
    with _BUILD:
        _PREFETCHER = _UNSET


def to_gpu(view: np.ndarray) -> bool:
    """Migrate the managed memory under ``view`` to the GPU now (a hint: see the
    module); ``True`` if the runtime did it, ``False`` where it cannot."""
    p = prefetcher() if ENABLED else None
    if p is None or not view.nbytes:
        return False
    try:
        p.prefetch(view.ctypes.data, view.nbytes)
    except Exception:  # a hint that did not happen; the memory is coherent either way
        return False
    return True
