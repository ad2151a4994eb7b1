"""The managed-memory prefetch (``muser_kv.managed``): which CUDA runtime call
it makes for which runtime version, that a failed call is a ``False`` (a hint
that did not happen, never an error of the load), and that it does nothing
where MLX runs without CUDA. The migration itself is measured on the H200
(``benchmarks/sessions.py``: warm loads with and without it)."""

import mlx.core as mx
import numpy as np
import pytest

from muser_kv import managed


class FakeRuntime:
    """The few CUDA runtime entry points the prefetcher calls, recorded."""

    def __init__(self, version: int, fail: int = 0):
        self.version, self.fail, self.calls = version, fail, []

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
    # on a non-blocking stream of its own, waited for before it returns
    assert rt.calls[0] == ("stream", managed.STREAM_NON_BLOCKING)
    assert rt.calls[-1] == ("sync", stream.value)


def test_each_thread_prefetches_on_its_own_stream_and_reuses_it():
    import threading

    rt = FakeRuntime(13000)
    p = managed.Prefetcher(rt, device=0)
    view = np.zeros(8, np.uint8)
    p.prefetch(view.ctypes.data, 8)
    p.prefetch(view.ctypes.data, 8)
    t = threading.Thread(target=p.prefetch, args=(view.ctypes.data, 8))
    t.start()
    t.join()
    streams = {args[-1].value for name, args in (c for c in rt.calls if c[0].startswith("cudaMem"))}
    assert len(streams) == 2 and [c[0] for c in rt.calls].count("stream") == 2


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
