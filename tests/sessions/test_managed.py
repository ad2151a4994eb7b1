"""The managed-memory prefetch (``muser_kv.managed``): which CUDA runtime call
it makes for which runtime version, that a failed call is a ``False`` (a hint
that did not happen, never an error of the load), and that it does nothing
where MLX runs without CUDA. The migration itself is measured on the H200
(``benchmarks/sessions.py``: warm loads with and without it)."""

import mlx.core as mx
import numpy as np
import pytest

from muser_kv.sessions import managed


class FakeRuntime:
    """The few CUDA runtime entry points the prefetcher calls, recorded."""

    def __init__(self, version: int, fail: int = 0):
        self.version, self.fail, self.calls = version, fail, []
        self.barrier = None

    def cudaRuntimeGetVersion(self, out):
        out._obj.value = self.version
        return 0

    def cudaStreamCreateWithFlags(self, out, flags):
        self.calls.append(("stream", flags))
        out._obj.value = 0x5000 + len(self.calls)
        return 0

    def _prefetch(self, name, *args):
        self.calls.append((name, args))
        return self.fail

    def cudaMemPrefetchAsync(self, *args):
        return self._prefetch("cudaMemPrefetchAsync", *args)

    def cudaMemPrefetchAsync_v2(self, *args):
        return self._prefetch("cudaMemPrefetchAsync_v2", *args)

    def cudaStreamSynchronize(self, stream):
        self.calls.append(("sync", stream.value))
        if self.barrier is not None:
            self.barrier.wait(timeout=10)
        return 0

    def cudaSetDevice(self, device):
        self.calls.append(("device", device))
        return 0

    def cudaGetLastError(self):
        self.calls.append(("clear",))
        return 0


def prefetch_call(rt):
    (name, args), = [c for c in rt.calls if c[0].startswith("cudaMem")]
    return name, args


@pytest.mark.parametrize("version, symbol, located", [
    (13000, "cudaMemPrefetchAsync", True),   # CUDA 13: the location form is the only one
    (12080, "cudaMemPrefetchAsync_v2", True),
    (12000, "cudaMemPrefetchAsync", False),  # before 12.2: an int device
])
def test_the_prefetch_uses_the_runtime_versions_own_form(version, symbol, located):
    rt = FakeRuntime(version)
    p = managed.Prefetcher(rt, device=3)
    view = np.zeros(1000, np.uint8)
    p.prefetch(view.ctypes.data, view.nbytes)
    name, args = prefetch_call(rt)
    assert name == symbol
    assert args[0].value == view.ctypes.data and args[1].value == view.nbytes
    if located:
        loc, flags, stream = args[2:]
        assert (loc.type, loc.id, flags.value) == (managed.LOCATION_DEVICE, 3, 0)
    else:
        device, stream = args[2:]
        assert device.value == 3
    # on this thread's device, on a non-blocking stream, waited for before it returns
    assert rt.calls[:2] == [("device", 3), ("stream", managed.STREAM_NON_BLOCKING)]
    assert rt.calls[-1] == ("sync", stream.value)


def test_calls_at_once_get_streams_of_their_own_and_later_calls_reuse_them():
    """As many streams as calls in flight at once, kept for every later load
    (one stream per load's reader thread would leak a set per load)."""
    import threading

    rt = FakeRuntime(13000)
    p = managed.Prefetcher(rt, device=0)
    view = np.zeros(8, np.uint8)
    rt.barrier = threading.Barrier(2)  # both in flight before either returns
    threads = [threading.Thread(target=p.prefetch, args=(view.ctypes.data, 8)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rt.barrier = None
    for _ in range(3):  # later calls, from this thread and from new ones
        p.prefetch(view.ctypes.data, 8)
        t = threading.Thread(target=p.prefetch, args=(view.ctypes.data, 8))
        t.start()
        t.join()
    used = {args[-1].value for name, args in rt.calls if name.startswith("cudaMem")}
    assert [c[0] for c in rt.calls].count("stream") == 2 and len(used) == 2


class NoV2(FakeRuntime):
    """A 12.2+ runtime that lacks ``cudaMemPrefetchAsync_v2``."""

    def __getattribute__(self, name):
        if name == "cudaMemPrefetchAsync_v2":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_runtime_without_the_entry_point_is_no_prefetcher(monkeypatch):
    with pytest.raises(AttributeError):
        managed.Prefetcher(NoV2(12080), device=0)  # found at construction, never mid-load
    monkeypatch.setattr(managed, "build", lambda: managed.Prefetcher(NoV2(12080), device=0))
    managed.reset()
    try:
        assert managed.prefetcher() is None
        assert managed.to_gpu(np.zeros(16, np.uint8)) is False
    finally:
        managed.reset()  # the next prefetcher() builds the real one


def test_a_failed_prefetch_is_false_and_clears_the_runtimes_error(monkeypatch):
    rt = FakeRuntime(13000, fail=1)  # cudaErrorInvalidValue: not managed memory
    monkeypatch.setattr(managed, "prefetcher", lambda: managed.Prefetcher(rt, device=0))
    assert managed.to_gpu(np.zeros(16, np.uint8)) is False
    assert ("clear",) in rt.calls  # left pending, MLX's next error check would find it
    ok = FakeRuntime(13000)
    monkeypatch.setattr(managed, "prefetcher", lambda: managed.Prefetcher(ok, device=0))
    assert managed.to_gpu(np.zeros(16, np.uint8)) is True
    assert managed.to_gpu(np.zeros(0, np.uint8)) is False  # nothing to move
    monkeypatch.setattr(managed, "ENABLED", False)
    assert managed.to_gpu(np.zeros(16, np.uint8)) is False


def test_the_runtime_is_found_in_the_process_mappings(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r--p 00000000 00:00 0 \n"
        "7f04-7f05 r-xp 00000000 08:01 2 /opt/nvidia/cu13/lib/libcudart.so.13\n")
    assert managed.loaded_runtime(str(maps)) == "/opt/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert managed.loaded_runtime(str(maps)) is None
    assert managed.loaded_runtime(str(tmp_path / "absent")) is None


@pytest.mark.skipif(mx.cuda.is_available(), reason="checks the build without CUDA")
def test_without_cuda_there_is_nothing_to_prefetch():
    assert managed.prefetcher() is None
    x = mx.zeros((64,), mx.float16)
    assert managed.to_gpu(np.asarray(x)) is False


# -- host reads of GPU arrays --------------------------------------------------------------


def _address(a: mx.array) -> int:
    return np.asarray(a.view(mx.uint8)).__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_host_copies_are_the_same_bits_in_other_buffers_where_host_reads_move(dtype,
                                                                             monkeypatch):
    """Bit for bit, -0.0 and NaN payloads included, and never the array's own
    buffer: the host reads the copy, the original stays where the GPU reads it."""
    words = np.array([0x8000, 0x7E01, 0x7FFF, 0x0001, 0x3C00, 0xFC00], np.uint16)
    width = 2 if dtype != mx.float32 else 1
    a = mx.array(np.tile(words, 4)).view(dtype).reshape(2, 3 * width, -1)
    mx.eval(a)
    # the CPU: nothing moves, nothing is copied; MLX CUDA: a copy
    assert (managed.host_copies([a])[0] is a) is not managed.host_reads_move()
    monkeypatch.setattr(managed, "host_reads_move", lambda: True)
    (c,) = managed.host_copies([a])
    mx.eval(c)
    assert c.dtype == a.dtype and c.shape == a.shape
    np.testing.assert_array_equal(np.array(c.view(mx.uint8)), np.array(a.view(mx.uint8)))
    assert _address(c) != _address(a)
