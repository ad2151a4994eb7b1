"""``muser-kv serve --kv-memory BYTES``: a server that admits a request only
while its planes fit.

The real command in a subprocess over a tiny Muse Glimmer whose context is
4,096 positions, so its global planes grow with each request. With a budget
that fits exactly two of the requests sent, four sent at once are all answered
with the tokens each gets alone (greedy, no prompt cache), the ones past two
waiting until another finishes; a request whose planes alone exceed the budget
is refused with 400 naming it, and a budget below one sequence's planes at
their smallest stops the server before it starts.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List

import metal_plugin
import pytest
from local_model import write_local_model
from servers import Server, ids, words

from muser_kv.serving.server import serve
from muser_kv.serving.server.kv_budget import KVBudget, KVMemoryExceeded, SequencePlanes

CONTEXT = 4096
PROMPT, TOKENS = 40, 60  # 100 positions: planes of 512 rows per global layer in a batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_local_model(tmp_path_factory.mktemp("model") / "muse",
                             max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def planes(model_dir) -> SequencePlanes:
    geometry = serve.check_model(str(model_dir), None)
    assert geometry is not None and geometry.max_context == CONTEXT
    return SequencePlanes.of(geometry, 2048)  # mlx-lm's --prefill-step-size default



def test_the_budget_counts_every_slot_at_the_longest_sequence(planes):
    assert planes.rows(1) == 256 and planes.rows(PROMPT + TOKENS) == 512
    assert planes.rows(CONTEXT) == CONTEXT  # never past the preallocated plane
    one = planes.bytes(100)
    two = 2 * one + planes.transient(2, 100)
    kv = KVBudget(two, planes)
    assert kv.fits(100)
    kv.admit("a", 100)
    assert kv.fits(90) and not kv.fits(1500)  # a longer one costs both slots more
    kv.admit("b", 90)
    assert kv.admitted_bytes == two and not kv.fits(1)
    kv.release("a")
    assert kv.fits(100)
    with pytest.raises(KVMemoryExceeded, match="need .* bytes \\(3000 positions"):
        kv.check(3000)
    with pytest.raises(ValueError, match="positive int of bytes"):
        KVBudget(0, planes)


def test_the_budget_counts_one_layers_old_planes_while_they_are_replaced(planes):
    """A growth (or a batch taking more slots) holds one layer's old planes
    until they are copied: a budget of the slots' planes alone admits one
    sequence fewer than it seems to."""
    rows = planes.rows(100)
    assert planes.transient(3, 100) == 3 * max(planes.layer_row_bytes * rows,
                                               planes.layer_ring_bytes) > 0
    assert 0 < planes.layer_row_bytes < planes.row_bytes  # one global layer of several
    kv = KVBudget(2 * planes.bytes(100), planes)
    kv.admit("a", 100)
    assert not kv.fits(100)  # two slots' planes fit; their transient does not
    kv = KVBudget(2 * planes.bytes(100) + planes.transient(2, 100), planes)
    kv.admit("a", 100)
    assert kv.fits(100)


def test_a_budget_below_one_sequence_is_refused_before_the_server_starts(model_dir, planes,
                                                                         capsys):
    least = planes.bytes(1) + planes.transient(1, 1)
    assert serve.main(["--model", str(model_dir), "--kv-memory", str(least - 1)]) == 2
    err = capsys.readouterr().err
    assert "--kv-memory" in err and f"smallest ({least:,} bytes)" in err


@pytest.fixture(scope="module")
def server(model_dir, planes, tmp_path_factory):
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the server runs the command itself, which does not install the tests' "
                    "Metal emulator")
    budget = KVBudget(1, planes).cost([PROMPT + TOKENS + 1] * 2)  # (+1: room for a BOS token)
    assert KVBudget(1, planes).cost([PROMPT + TOKENS] * 3) > budget
    s = Server(model_dir, tmp_path_factory.mktemp("logs") / "kv.log", "--prompt-cache-size",
               "0", "--kv-memory", str(budget), "--log-level", "INFO")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


#: the local tokenizer's </s> (vocab 256, last): kept out, so every answer runs to max_tokens
EOS = 255


def complete(server: Server, prompt: List[int], max_tokens: int = TOKENS) -> List[int]:
    out = server.post("/v1/completions", {"prompt": words(prompt), "max_tokens": max_tokens,
                                          "temperature": 0, "logprobs": True,
                                          "logit_bias": {str(EOS): -1000}})
    return [t["id"] for t in out["choices"][0]["logprobs"]["content"]]


def test_requests_past_the_budget_wait_and_are_answered_exactly(server):
    prompts = [ids(PROMPT, 10 + i) for i in range(4)]
    solo = [complete(server, p) for p in prompts]
    assert "waits for KV memory" not in server.log()
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: complete(server, p), prompts))
    assert together == solo
    assert all(len(t) == TOKENS for t in solo) and len({tuple(t) for t in solo}) == 4
    assert "waits for KV memory" in server.log()


def test_a_request_whose_planes_alone_exceed_the_budget_is_refused(server):
    status, out = server.send("/v1/completions", {"prompt": words(ids(1500, 3)),
                                                  "max_tokens": 20, "temperature": 0})
    assert status == 400, (status, out)
    assert "more than this server's --kv-memory" in str(out)
    assert len(complete(server, ids(PROMPT, 4))) == TOKENS  # and the server goes on
