"""The server's warm-up (``muser_kv.serving.server.warm_up``): a loaded
model's first forward, decode steps, a KV store put and its rebuild, run on
throwaway caches before ``/health`` says ready. It must run on every family
muser-kv serves (a failure there would be a log line and a cold first
request), and leave nothing a request sees."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from local_model import write_local_model
from model_zoo import MAX_CONTEXT, ZOO, tiny
from servers import serve_args

import muser_kv
from muser_kv.serving.server import serve
from muser_kv.serving.server.warm_up import warm_up

LOGGER = "muser_kv.serving.server.warm_up"


def records(caplog, level: int):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= level]


@pytest.mark.parametrize("name", list(ZOO))
def test_the_warm_up_runs_on_every_family(name, caplog):
    model = tiny(name, mx.float16)
    muser_kv.install(model, max_context=MAX_CONTEXT)
    caplog.set_level(logging.INFO, logger=LOGGER)
    warm_up(model)
    assert not records(caplog, logging.WARNING), [r.getMessage() for r in caplog.records]
    done = [r.getMessage() for r in records(caplog, logging.INFO)]
    assert len(done) == 1 and "warmed up" in done[0], done


def test_the_warm_up_changes_nothing_a_request_sees(caplog):
    model = tiny("muse_glimmer", mx.float16)
    muser_kv.install(model, max_context=MAX_CONTEXT)
    tokens = mx.array([list(range(40))])
    before = np.array(model(tokens, cache=model.make_cache()).view(mx.uint16))
    state = [np.array(s) for s in mx.random.state]
    caplog.set_level(logging.INFO, logger=LOGGER)
    warm_up(model)
    assert records(caplog, logging.INFO) and not records(caplog, logging.WARNING)
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(state, mx.random.state))
    after = np.array(model(tokens, cache=model.make_cache()).view(mx.uint16))
    np.testing.assert_array_equal(before, after)


def test_a_failed_warm_up_is_a_log_line_not_a_failed_load(tmp_path, caplog, monkeypatch):
    """The server loads and serves; the warm-up's failure is logged with its cause."""
    provider = serve.MuseModelProvider(serve_args(["--model", str(write_local_model(
        tmp_path / "muse"))]))

    def broken(*_args, **_kwargs):
        raise RuntimeError("no forward today")

    monkeypatch.setattr("muser_kv.serving.server.warm_up.fresh_list", broken)
    caplog.set_level(logging.INFO, logger=LOGGER)
    provider.load("default_model")
    assert provider.ready and muser_kv.installed(provider.model) is not None
    failed = records(caplog, logging.ERROR)
    assert len(failed) == 1 and "warm-up failed" in failed[0].getMessage()
    assert "no forward today" in caplog.text


def test_the_server_warms_up_as_it_loads(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    provider = serve.MuseModelProvider(serve_args(["--model", str(write_local_model(
        tmp_path / "muse"))]))
    assert not records(caplog, logging.INFO)
    provider.load("default_model")
    assert provider.ready
    assert [r.getMessage().split(" in ")[0] for r in records(caplog, logging.INFO)] == [
        "muser-kv serve: warmed up"]
