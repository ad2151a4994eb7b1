"""``muser-kv serve --kv-store``, as a client sees it: the real command in a
subprocess (tests/servers.py), over a tiny random-weight Muse Glimmer with a
2048-token context and a window of 16 (every prompt here wraps every ring many
times), greedy, tokens read from ``logprobs``.

These servers keep no in-memory prompt-cache entries (``--prompt-cache-size
0``), so every reuse here is the store's: ``cached_tokens`` says how much it
rebuilt. A rebuilt list is the live list's state bit for bit, so a request
answered from it gives the tokens the same request gave on the server that
stored it (greedy; the same state, the same logits)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List, Sequence, Tuple

import metal_plugin
import pytest
from local_model import write_local_model
from servers import Server, ids, words

CONTEXT = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the servers run the command itself, which does not install the tests' "
                    "Metal emulator (the store runs emulated in-process: test_store)")
    return write_local_model(tmp_path_factory.mktemp("model") / "muse",
                             max_position_embeddings=CONTEXT)



def complete(server: Server, prompt: Sequence[int], max_tokens: int = 24) -> Tuple[List[int], int]:
    out = server.post("/v1/completions", {"prompt": words(prompt), "max_tokens": max_tokens,
                                          "temperature": 0, "logprobs": True})
    got = [t["id"] for t in out["choices"][0]["logprobs"]["content"]]
    return got, out["usage"].get("prompt_tokens_details", {}).get("cached_tokens") or 0


def serve(model_dir: Path, logs: Path, name: str, *flags: str) -> Server:
    server = Server(model_dir, logs / f"{name}.log", "--prompt-cache-size", "0", "--retain", "8",
                    "--log-level", "INFO", *flags)
    server.wait_ready()
    return server


def settled(count, timeout: float = 20.0) -> int:
    """Wait until ``count()`` stops changing (the writer thread has drained)."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif now > 0 and time.monotonic() - since > 1.0:
            return now
        time.sleep(0.1)
    raise AssertionError(f"the store kept changing for {timeout} s (last count {last})")


def chunk_files(directory: Path) -> List[Path]:
    return [p for p in directory.glob("??/*") if p.is_file() and not p.name.startswith(".")]


def test_regenerate_restart_and_a_corrupted_chunk_over_a_directory(model_dir, tmp_path):
    store = tmp_path / "store"
    prompt = ids(600, 1)
    a = serve(model_dir, tmp_path, "a", "--kv-store", str(store))
    try:
        answer, cached = complete(a, prompt, max_tokens=40)
        assert cached == 0
        # regenerate: the answer (40 tokens) outran the 8 retained rows; the
        # store rebuilds the prompt less its last token, where the server put it
        again, cached = complete(a, prompt, max_tokens=40)
        assert cached == 599
        assert again == answer
        returning = prompt + answer + ids(30, 2)
        before, cached = complete(a, returning)
        assert cached >= len(prompt) + len(answer) - 1
        settled(lambda: len(chunk_files(store)))
    finally:
        a.stop()
    # a restarted server over the same directory: the chat comes back from disk
    b = serve(model_dir, tmp_path, "b", "--kv-store", str(store))
    try:
        got, cached = complete(b, returning)
        assert cached >= len(prompt) + len(answer) - 1
        assert got == before
        assert b.get("/health") == 200
    finally:
        b.stop()
    # every stored chunk with one bit flipped: misses, never served; the request succeeds
    for path in chunk_files(store):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    c = serve(model_dir, tmp_path, "c", "--kv-store", str(store))
    try:
        got, cached = complete(c, returning)
        assert cached == 0
        assert len(got) == 24
        assert "digest" in c.log() or "not what" in c.log() or "corrupt" in c.log().lower()
        assert c.get("/health") == 200
    finally:
        c.stop()


def test_two_servers_over_one_redis_and_redis_killed_mid_use(model_dir, tmp_path, redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    one = serve(model_dir, tmp_path, "one", "--kv-store", redis_server.url)
    two = serve(model_dir, tmp_path, "two", "--kv-store", redis_server.url)
    try:
        prompt = ids(700, 3)
        answer, cached = complete(one, prompt)
        assert cached == 0
        settled(lambda: client.dbsize())
        returning = prompt + answer + ids(20, 4)
        got, cached = complete(two, returning)  # prefilled by one, continued by two
        assert cached >= len(prompt) + len(answer) - 1
        assert got == complete(one, returning)[0]
        redis_server.kill()
        fresh = ids(500, 5)
        started = time.monotonic()
        tokens, cached = complete(two, fresh)  # Redis is gone: a fresh prefill, and it serves
        assert cached == 0 and len(tokens) == 24
        assert time.monotonic() - started < 30
        again, cached = complete(two, returning)  # its memory tier still has the chat
        assert again == got and cached >= len(prompt) + len(answer) - 1
        assert two.get("/health") == 200
    finally:
        one.stop()
        two.stop()


def test_an_edit_inside_a_long_prompt_comes_back_from_its_checkpoint(model_dir, tmp_path):
    """``--kv-store-checkpoint 256``: the server puts the prompt's state at 256,
    512, 768 and 1024 on its way through 1,100 tokens; a request editing token
    700 is rebuilt at 512 and answers what a server with no store answers (the
    same prefill steps: 256 tokens each)."""
    prompt = ids(1100, 6)
    change = list(prompt)
    change[700] = 2 if change[700] != 2 else 3
    a = serve(model_dir, tmp_path, "checkpoints", "--kv-store-checkpoint", "256",
              "--prefill-step-size", "256")
    b = serve(model_dir, tmp_path, "none", "--kv-store-memory", "0", "--prefill-step-size", "256")
    try:
        _, cached = complete(a, prompt, max_tokens=8)
        assert cached == 0
        got, cached = complete(a, change, max_tokens=8)
        assert cached == 512
        assert "rebuilt 512 tokens from the KV store" in a.log()
        want, cached = complete(b, change, max_tokens=8)
        assert cached == 0 and got == want
    finally:
        a.stop()
        b.stop()
