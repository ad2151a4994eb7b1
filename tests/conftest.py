import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import metal_plugin  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx_lm_kernels  # noqa: E402  (before the emulator: mlx-lm builds its kernels at import)
from mlx_lm.models import muse_glimmer  # noqa: E402

if os.environ.get(metal_plugin.EMULATOR_ENV):  # a child process of an emulated-Metal run
    metal_plugin.install()


def pytest_addoption(parser):
    metal_plugin.addoption(parser)
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N shards (1-based) of the collected tests, dealt "
                          "round-robin in collection order (the GPU runs the suite one "
                          "device call per shard: benchmarks/device.sh suite K N)")


def pytest_configure(config):
    metal_plugin.configure(config)


def pytest_collection_modifyitems(config, items):
    metal_plugin.collection_modifyitems(config, items)
    shard = config.getoption("--shard")
    if shard:
        k, n = (int(x) for x in shard.split("/"))
        if not 1 <= k <= n:
            raise pytest.UsageError(f"--shard K/N needs 1 <= K <= N, got {shard}")
        config.hook.pytest_deselected(items=[x for i, x in enumerate(items) if i % n != k - 1])
        items[:] = [x for i, x in enumerate(items) if i % n == k - 1]


def pytest_sessionfinish(session, exitstatus):
    metal_plugin.sessionfinish(session)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pytest-xdist's: a worker ended
    metal_plugin.testnodedown(node)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    metal_plugin.terminal_summary(terminalreporter)


@pytest.fixture(autouse=True)
def mlx_lm_kernel_standins(request):
    """Muse Spark's forward calls mlx-lm's fused Metal kernels: on a device
    without Metal every test runs it on their stand-ins (``mlx_lm_kernels``),
    mlx-lm's caches and muser-kv's alike, but a test marked
    ``mlx_lm_metal_kernels`` (what a user without Metal gets)."""
    if request.node.get_closest_marker("mlx_lm_metal_kernels"):
        yield False
        return
    with mlx_lm_kernels.standins() as patched:
        yield patched


@pytest.fixture(autouse=True)
def mlx_cuda_attention_switch():
    """A test that parses serve's flags sets the switch for its process, as the
    server does for its own; it must not pass on to later tests, whose child
    processes (a handoff's ranks) would then compute with other kernels than
    the test process that checks them."""
    from muser_kv.serving.server.serve_flags import CUDNN_SWITCH

    before = os.environ.get(CUDNN_SWITCH)
    yield
    if before is None:
        os.environ.pop(CUDNN_SWITCH, None)
    else:
        os.environ[CUDNN_SWITCH] = before


@pytest.fixture
def mlx_attention():
    """Decode attention left to MLX's for one test (``MUSER_KV_ATTENTION=mlx``):
    for a test of the caches against mlx-lm's own through the same attention
    (bit for bit), or of what MLX's attention does with what a cache hands it."""
    import muser_kv

    before = muser_kv.decode_attention()
    muser_kv.set_decode_attention("mlx")
    yield
    muser_kv.set_decode_attention(before)


@pytest.fixture(scope="session")
def emulator():
    """The Metal emulator (tests/metal_emulator.py). Without clang++ it skips on a
    developer's machine and fails where MUSER_KV_REQUIRE_CLANG is set (CI)."""
    import platform

    from metal_emulator import REQUIRE_ENV, ClangMissing, default_emulator

    if not (platform.system() == "Linux" and platform.machine() == "x86_64"):
        pytest.skip("the Metal emulator runs on Linux x86-64")
    try:
        return default_emulator()
    except ClangMissing as e:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{e} ({REQUIRE_ENV} is set: CI must compile the Metal text)",
                        pytrace=False)
        pytest.skip(str(e))


def tiny_args(**kw) -> muse_glimmer.ModelArgs:
    """Muse-Glimmer-shaped: real 2 x 128 KV geometry, tiny hidden size."""
    base = dict(hidden_size=64, num_hidden_layers=8, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                vocab_size=256, sliding_window=16, max_position_embeddings=256)
    base.update(kw)
    return muse_glimmer.ModelArgs(**base)


def tiny_model(dtype=mx.float32, seed=0, **kw) -> muse_glimmer.Model:
    mx.random.seed(seed)
    model = muse_glimmer.Model(tiny_args(**kw))
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def model_f32():
    return tiny_model(mx.float32)


@pytest.fixture(scope="session")
def model_f16():
    return tiny_model(mx.float16)


@pytest.fixture(scope="session")
def local_muse_model(tmp_path_factory) -> Path:
    """The default tiny Muse Glimmer on disk (bf16 weights, seed 0), written once."""
    from local_model import write_local_model

    return write_local_model(tmp_path_factory.mktemp("muse_glimmer"))


@pytest.fixture
def redis_server(tmp_path_factory):
    """A real ``redis-server`` on a free loopback port for one test
    (tests/servers.py, ``RedisServer``: ``.url``, ``.kill()``, ``.restart()``).
    Without ``redis-server`` or the redis package it skips on a developer's
    machine and fails where MUSER_KV_REQUIRE_REDIS is set (CI)."""
    from servers import REQUIRE_REDIS_ENV, RedisMissing, RedisServer

    try:
        import redis  # noqa: F401
        server = RedisServer(tmp_path_factory.mktemp("redis"))
    except (ImportError, RedisMissing) as e:
        if os.environ.get(REQUIRE_REDIS_ENV):
            pytest.fail(f"{e} ({REQUIRE_REDIS_ENV} is set: CI must run the Redis tests)", pytrace=False)
        pytest.skip(str(e))
    try:
        yield server
    finally:
        server.stop()
