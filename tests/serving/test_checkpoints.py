"""Checkpoints inside long prompts (``muser_kv.serving.checkpoints``): the KV
store puts a prompt's state at every multiple of ``--kv-store-checkpoint`` its
prefill passes, so a request that edits a long prompt in its middle is rebuilt
from the deepest checkpoint at or below the edit and only the rest is
prefilled.

The server tests run mlx-lm's own generation thread in this process
(``MuseResponseGenerator`` over a ``MuseModelProvider``: mlx-lm's ``_generate``
loop, its ``BatchGenerator.insert_segments`` / ``extract_cache`` and its
``while N > 0`` drop of the segments a reused prefix covers), with no HTTP, on
a tiny random-weight Muse Glimmer on disk (4 layers, window 16: every prompt
wraps every ring ~70 times), f16 and bf16, greedy. The first token's log-probabilities are
read where mlx-lm's server formats them (``_format_top_logprobs``), whole and
bit for bit."""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import mlx_lm.server as mlx_server
import numpy as np
import pytest
from local_model import write_local_model
from servers import generation_args, ids, serve_args, words

import muser_kv
from muser_kv.serving.checkpoints import (
    CHECKPOINT,
    checkpoint_interval,
    checkpoints,
    prefill_pieces,
    split_segments,
)
from muser_kv.serving.cli import main as muser_kv_main
from muser_kv.serving.server import serve
from muser_kv.serving.server.prompt_cache import ExactPromptCache
from muser_kv.sessions import reading
from muser_kv.sessions.store import planner

CONTEXT = 2048
EVERY = 256  # --kv-store-checkpoint in these tests
STEP = 128  # --prefill-step-size: two prefill steps per checkpoint interval
START_TIMEOUT = 60



def bits(x: mx.array) -> np.ndarray:
    return np.array(x.view(mx.uint16))


def edited(prompt: List[int], at: int) -> List[int]:
    out = list(prompt)
    out[at] = 2 if out[at] != 2 else 3
    return out


# -- the split itself -----------------------------------------------------------------------


def test_segments_are_cut_at_absolute_multiples_and_keep_their_types():
    prompt = list(range(1000))
    segments, types = [prompt[:300], prompt[300:990], prompt[990:]], ["system", "user", "assistant"]
    got, kinds = split_segments(segments, types, 256)
    assert [len(s) for s in got] == [256, 44, 212, 256, 222, 10]
    assert kinds == [CHECKPOINT, "system", CHECKPOINT, CHECKPOINT, "user", "assistant"]
    assert sum(got, []) == prompt  # nothing lost, nothing reordered
    ends = np.cumsum([len(s) for s in got])
    assert [int(e) for e, k in zip(ends, kinds) if k == CHECKPOINT] == [256, 512, 768]
    # 0 is mlx-lm's split, unchanged
    assert split_segments(segments, types, 0) == (segments, types)


def test_the_prompts_end_is_left_to_mlx_lm():
    """mlx-lm splits the last token off itself and inserts the cache before it
    with the last segment's type (the prompt cache's entry a regenerate lands
    on): a checkpoint there would take that type, so none is cut there; nor at
    an original boundary, nor past the prompt."""
    got, kinds = split_segments([list(range(513))], ["assistant"], 256)
    assert [len(s) for s in got] == [256, 257] and kinds == [CHECKPOINT, "assistant"]
    got, kinds = split_segments([list(range(256)), list(range(256))], ["user", "assistant"], 256)
    assert [len(s) for s in got] == [256, 256] and kinds == ["user", "assistant"]
    assert split_segments([[1, 2, 3]], ["assistant"], 256) == ([[1, 2, 3]], ["assistant"])
    assert checkpoints(0, 1024, 256) == [256, 512, 768]
    assert checkpoints(300, 1025, 256) == [512, 768, 1024]
    assert prefill_pieces(100, 700, 256) == [(100, 256), (256, 512), (512, 700)]
    assert prefill_pieces(512, 700, 256) == [(512, 700)]
    assert prefill_pieces(0, 600, 0) == [(0, 600)]


@pytest.mark.parametrize("text", ["-256", "100", "257", "x"])
def test_the_interval_is_0_or_a_positive_multiple_of_a_chunk(text):
    with pytest.raises(argparse.ArgumentTypeError, match="multiple of 256"):
        checkpoint_interval(text)
    assert checkpoint_interval("0") == 0 and checkpoint_interval("8192") == 8192


def test_serve_refuses_an_interval_that_is_not_a_multiple_of_a_chunk(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--model", "nowhere", "--kv-store-checkpoint", "1000"])
    assert e.value.code == 2
    assert "--kv-store-checkpoint" in capsys.readouterr().err


def parse(argv: List[str]) -> Any:
    return serve_args(argv)


def test_a_checkpoints_put_copies_its_intervals_global_rows_and_the_windows_sliding_rows():
    """A put at a checkpoint copies the interval's new ``G`` chunks, the window's
    whole ``S`` chunks and an empty point (a window of 256 rows, a multiple of
    the chunk as Muse Glimmer's 2,048 is: no fragments); the prompt's own put
    after it copies only what came since. Every ``G`` chunk is copied once,
    checkpoints or not: what they add is the window's rows per interval."""
    from conftest import tiny_model

    model = tiny_model(mx.float16, num_hidden_layers=4, head_dim=32, sliding_window=256,
                       max_position_embeddings=CONTEXT)
    g_chunk = 256 * 1 * 2 * 2 * 32 * 2  # positions x global layers x (K, V) x heads x dim x 2 B
    s_chunk = 3 * g_chunk  # three sliding layers
    tokens = ids(1100, 8)
    for every in (EVERY, 0):
        store = muser_kv.KVStore()
        cache = muser_kv.make_prompt_cache(model)
        reports = []
        for lo, hi in prefill_pieces(0, 1099, every):
            for at in range(lo, hi, STEP):
                model(mx.array(tokens[at:min(at + STEP, hi)])[None], cache=cache)
            reports.append(store.put(tokens[:hi], cache, model))
        if every:
            assert [r.position for r in reports] == [256, 512, 768, 1024, 1099]
            for r in reports[:4]:  # one G, one S (the window), an empty point
                assert r.copied == 3 and r.copied_bytes == g_chunk + s_chunk
            assert set(store.rebuildable(tokens, model)) >= {256, 512, 768, 1024, 1099}
            with_checkpoints = store.stats().copied_bytes
        else:
            assert [r.position for r in reports] == [1099]
            assert store.rebuildable(tokens, model) == [1099]
            assert with_checkpoints - store.stats().copied_bytes == 4 * s_chunk


# -- the server, in-process --------------------------------------------------------------------


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def model_dir(request, tmp_path_factory) -> Path:
    return write_local_model(tmp_path_factory.mktemp(f"muse-{request.param}") / "muse",
                             dtype=request.param, max_position_embeddings=CONTEXT,
                             num_hidden_layers=4, head_dim=32)


class Server:
    """mlx-lm's generation thread with muser-kv's substitutions, fed requests
    as its HTTP handler feeds them; records what the prompt cache is given."""

    def __init__(self, model_dir: Path, *flags: str):
        self.args = parse(["--model", str(model_dir), "--retain", "8",
                           "--prefill-step-size", str(STEP), *flags])
        self.provider = serve.MuseModelProvider(self.args)
        self.pcache = ExactPromptCache(self.args.prompt_cache_size)
        self.inserted: List[Tuple[int, str]] = []
        insert = self.pcache.insert_cache

        def recording(model, tokens, cache, *, cache_type="assistant"):
            insert(model, tokens, cache, cache_type=cache_type)
            self.inserted.append((len(tokens), cache_type))  # once inserted (and put)

        self.pcache.insert_cache = recording  # type: ignore[method-assign]
        self.gen = serve.MuseResponseGenerator(self.provider, self.pcache)
        deadline = time.monotonic() + START_TIMEOUT
        while self.provider.limits is None:  # the generation thread loads the model
            assert time.monotonic() < deadline and self.gen.generation_available()
            time.sleep(0.02)

    @property
    def store(self):
        return self.pcache.store

    def ask(self, prompt: List[int], max_tokens: int = 4) -> Dict[str, Any]:
        """One completion: its tokens, the prompt tokens reused, and the first
        token's log-probabilities (bits)."""
        seen: List[np.ndarray] = []
        real = mlx_server._format_top_logprobs

        def capture(logprobs, top_n, tokenizer):
            seen.append(np.array(logprobs.astype(mx.float32)).view(np.uint32))
            return real(logprobs, top_n, tokenizer)

        mlx_server._format_top_logprobs = capture
        try:
            self.inserted.clear()
            request = mlx_server.CompletionRequest("text", words(prompt), [], None, None)
            ctx, responses = self.gen.generate(request, generation_args(max_tokens))
            tokens = [r.token for r in responses]
            # mlx-lm ends the stream before it inserts the answer: wait for that
            deadline = time.monotonic() + START_TIMEOUT
            while not any(n > len(prompt) for n, _ in self.inserted):
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            mlx_server._format_top_logprobs = real
        return {"tokens": tokens, "reused": ctx.prompt_cache_count, "first": seen[0],
                "inserted": list(self.inserted)}

    def stop(self) -> None:
        self.gen.stop_and_join()


@pytest.fixture
def running():
    started: List[Server] = []

    def start(model_dir: Path, *flags: str) -> Server:
        server = Server(model_dir, *flags)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def test_an_edit_inside_a_long_prompt_is_rebuilt_from_the_checkpoint_below_it(model_dir,
                                                                                running):
    """A 1,100-token prompt (4 checkpoint intervals, ~70 ring wraps): the store
    gets its state at 256, 512, 768, 1024 and at the prompt less its last token.
    A request editing token 700 is rebuilt at 512 (the deepest checkpoint at or
    below it: the entries cannot trim 700 tokens back), only the rest is
    prefilled, and its first token's log-probabilities are those of a fresh
    server running the edited prompt, bit for bit (the same segments from 512
    on: the same prefill steps)."""
    prompt = ids(1100, 1)
    a = running(model_dir, "--kv-store-checkpoint", str(EVERY))
    first = a.ask(prompt)
    assert first["reused"] == 0
    assert first["inserted"] == [(256, CHECKPOINT), (512, CHECKPOINT), (768, CHECKPOINT),
                                 (1024, CHECKPOINT), (1099, "assistant"),
                                 (1104, "assistant")]  # the answer: mlx-lm's key, one past the list
    assert {256, 512, 768, 1024, 1099} <= set(a.store.rebuildable(prompt, a.provider.model))
    change = edited(prompt, 700)
    again = a.ask(change)
    assert again["reused"] == 512
    assert again["inserted"][:3] == [(768, CHECKPOINT), (1024, CHECKPOINT), (1099, "assistant")]
    fresh = running(model_dir, "--kv-store-checkpoint", str(EVERY)).ask(change)
    assert fresh["reused"] == 0
    assert np.array_equal(again["first"], fresh["first"])
    assert again["tokens"] == fresh["tokens"]
    # the checkpoints cut prefill steps only where STEP already does: a server
    # without them computes the same bits
    plain = running(model_dir, "--kv-store-checkpoint", "0").ask(change)
    assert np.array_equal(plain["first"], fresh["first"])
    # an edit in the first interval: nothing below it to rebuild
    assert a.ask(edited(prompt, 100))["reused"] == 0


def test_the_rebuilt_list_is_the_live_list_at_the_checkpoint(model_dir, running):
    """The list the server extracted at a checkpoint, row for row and ring for
    ring, is what the store rebuilds there for a prompt that shares it."""
    prompt = ids(900, 2)
    a = running(model_dir, "--kv-store-checkpoint", str(EVERY))
    kept: Dict[int, Any] = {}
    put = a.store.put

    def keeping(tokens, cache, model=None):  # on the generation thread (its stream)
        kept[len(tokens)] = [(s, bits(k), bits(v)) for s, k, v in (c.snapshot() for c in cache)]
        return put(tokens, cache, model)

    a.store.put = keeping
    a.ask(prompt)
    n, rebuilt = a.store.longest_prefix(edited(prompt, 600), a.provider.model)
    assert n == 512 and 512 in kept
    for (start, k, v), c in zip(kept[512], rebuilt):
        got = c.snapshot()
        assert got[0] == start
        for x, y in ((bits(got[1]), k), (bits(got[2]), v)):
            assert x.shape == y.shape and np.array_equal(x, y)


def test_a_checkpoint_is_never_a_prompt_cache_entry(model_dir, running):
    prompt = ids(1100, 3)
    on = running(model_dir, "--kv-store-checkpoint", str(EVERY))
    off = running(model_dir, "--kv-store-checkpoint", "0")
    got, want = on.ask(prompt), off.ask(prompt)
    assert [t for _, t in got["inserted"]].count(CHECKPOINT) == 4
    assert off.store.stats().puts == 2 and on.store.stats().puts == 6
    assert (len(on.pcache), on.pcache.nbytes) == (len(off.pcache), off.pcache.nbytes)
    assert got["tokens"] == want["tokens"]
    assert on.pcache.stats_by_type() == off.pcache.stats_by_type()


def test_a_returning_turn_checkpoints_only_what_it_prefills(model_dir, running):
    """The next turn reuses the last answer's entry: mlx-lm drops the segments
    it covers (and their types) and slices the one it ends in; the checkpoints
    past it are put, every type still names the cache at its segment's end."""
    a = running(model_dir, "--kv-store-checkpoint", str(EVERY))
    prompt = ids(1100, 4)
    first = a.ask(prompt)
    turn = prompt + first["tokens"] + ids(300, 5)
    second = a.ask(turn)
    assert second["reused"] == len(prompt) + len(first["tokens"])  # mlx-lm fed the last one too
    assert second["inserted"][:2] == [(1280, CHECKPOINT), (len(turn) - 1, "assistant")]


def test_tokenize_cuts_only_with_a_store_and_an_interval(model_dir, running):
    request = mlx_server.CompletionRequest("text", words(ids(600, 6)), [], None, None)
    for flags, want in (((), ["assistant"]),  # the default interval: past this prompt
                        (("--kv-store-checkpoint", "256"), [CHECKPOINT, CHECKPOINT, "assistant"]),
                        (("--kv-store-checkpoint", "256", "--kv-store-memory", "0"),
                         ["assistant"])):
        s = running(model_dir, *flags)
        prompt, segments, types, *_ = s.gen._tokenize(
            s.provider.limits.tokenizer, copy.deepcopy(request), generation_args(4))
        assert types == want and sum(segments, []) == prompt
        s.stop()


def test_serve_prepares_its_store_when_the_model_loads(model_dir, running, tmp_path, monkeypatch):
    """A server restarted over a store directory takes the model's fingerprint
    and makes its reads' landing buffers when the model loads: the returning
    request's rebuild samples no weight, and lands in buffers already made,
    which the idle server makes again."""
    prompt = ids(700, 7)
    where = str(tmp_path / "store")
    a = running(model_dir, "--kv-store", where)
    a.ask(prompt)
    a.stop()
    b = running(model_dir, "--kv-store", where)
    deadline = time.monotonic() + START_TIMEOUT
    while not b.store.landing.nbytes:  # the hook runs on the generation thread, after limits
        assert time.monotonic() < deadline
        time.sleep(0.01)
    prepared = b.store.landing.nbytes
    sampled, on_demand = [], []
    real_bytes = reading.host_bytes
    monkeypatch.setattr(planner, "model_fingerprint", lambda m: sampled.append(m))
    monkeypatch.setattr(reading, "host_bytes", lambda n: on_demand.append(n) or real_bytes(n))
    again = b.ask(prompt[:-1] + [3])
    assert again["reused"] >= 512 and b.store.stats().read_bytes > 0
    assert sampled == [] and len(on_demand) <= 1  # a point's payload: points are not stocked
    while b.store.landing.nbytes < prepared:  # made again while the server idles
        assert time.monotonic() < deadline + START_TIMEOUT
        time.sleep(0.01)


# -- generate --kv-store ---------------------------------------------------------------------


class Recorder:
    """mlx-lm's ``stream_generate`` (what the commands' store wraps), recording
    each response's log-probabilities (bits)."""

    def __init__(self, inner):
        self.inner, self.first = inner, []

    def __call__(self, *args, **kwargs):
        for i, response in enumerate(self.inner(*args, **kwargs)):
            if i == 0:
                self.first.append(np.array(response.logprobs.astype(mx.float32)).view(np.uint32))
            yield response


def test_generate_reuses_the_checkpoint_below_an_edit(model_dir, tmp_path, capsys, monkeypatch):
    import importlib

    module = importlib.import_module("mlx_lm.generate")
    recorder = Recorder(module.stream_generate)
    monkeypatch.setattr(module, "stream_generate", recorder)
    prompt = ids(1100, 7)  # + the chat template's t1

    def generate(tokens, store):
        argv = ["generate", "--model", str(model_dir), "--prompt", words(tokens), "--max-tokens",
                "8", "--temp", "0", "--kv-store", str(store), "--kv-store-checkpoint", str(EVERY)]
        assert muser_kv_main(argv) == 0
        out = capsys.readouterr()
        return out.out.split("==========")[1], out.err

    generate(prompt, tmp_path / "store")
    change = edited(prompt, 700)
    text, err = generate(change, tmp_path / "store")
    assert "512 of the prompt's 1101 tokens rebuilt" in err
    fresh, err = generate(change, tmp_path / "fresh")
    assert "rebuilt" not in err
    assert text == fresh
    assert np.array_equal(recorder.first[1], recorder.first[2])
    store = muser_kv.KVStore(str(tmp_path / "store"))
    from mlx_lm import load

    model, _ = load(str(model_dir))
    muser_kv.install(model, max_context=CONTEXT)
    assert {256, 512, 768, 1024, 1100} <= set(store.rebuildable(prompt + [1], model))
    store.close()


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_commands_refuse_an_interval_that_is_not_a_multiple_of_a_chunk(command, capsys):
    with pytest.raises(SystemExit) as e:
        muser_kv_main([command, "--model", "nowhere", "--kv-store-checkpoint", "300"])
    assert e.value.code == 2
    assert "--kv-store-checkpoint" in capsys.readouterr().err
