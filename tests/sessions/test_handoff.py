"""Sessions handed between two local processes over MLX's ring backend.

Each run starts two processes (tests/handoff_child.py; loopback only) that
write what they saw; the tests here judge it. A run is bounded by
``RUN_TIMEOUT`` and its processes are stopped in a ``finally``, whatever
happened. The bitwise tests also check that the positions used tell a
rotation-preserving install from one packed at physical row 0, so they can fail.
Every run goes once per transport: ``"auto"`` (``"p2p"`` on a ring group: send
and recv) and ``"collective"`` forced (the ring backend's all_gather / all_sum,
as MLX's NCCL backend would carry it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from handoff_child import (
    CONTINUE,
    FIRST,
    KW,
    MIDWAY,
    PROMPT,
    SECOND,
    STALL_TIMEOUT,
    STALLED_SENDER_TIMEOUT,
    decode,
    prefill,
)
from metal_plugin import EMULATOR_ENV
from ring_pair import ROOT, RingPair, child_env

import muser_kv
import muser_kv.caches.cachelist
from muser_kv import Ring
from muser_kv.sessions import handoff

sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import launch_port  # noqa: E402  (mlx.launch wants two consecutive ports)

HERE = Path(__file__).resolve().parents[1]
CHILD = HERE / "handoff_child.py"
RUN_TIMEOUT = 150
TRANSPORTS = ["auto", "collective"]

pytestmark = pytest.mark.skipif(not mx.distributed.is_available("ring"),
                                reason="MLX's ring backend is not available")


def run(scenario: str, folder: Path, transport: str = "auto"):
    """Both ranks' reports of one run (None for a rank that wrote none), and the logs."""
    with RingPair(CHILD, [scenario, str(folder), transport], folder) as pair:
        codes = pair.wait(RUN_TIMEOUT)
        logs = pair.logs()
    assert None not in codes, f"{scenario}: still running after {RUN_TIMEOUT} s\n{logs}"
    reports = []
    for rank in (0, 1):
        path = folder / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else None)
    return codes, reports, logs


@pytest.fixture(scope="module")
def model():
    return tiny_model(mx.float16, **KW)


@pytest.fixture(scope="module", params=TRANSPORTS)
def exact(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp(f"handoff-exact-{request.param}")
    codes, (sender, receiver), logs = run("exact", folder, request.param)
    assert codes == [0, 0], logs
    return folder, sender, receiver, logs


def packed_at_zero(cache):
    """The same rows with every wrapped ring installed from physical row 0
    (the replay gate's negative control)."""
    for i, c in enumerate(cache):
        ring = c.ring
        if ring.origin_physical == 0:
            continue
        start, k, v = c.snapshot()
        flat = (ring.len, c.kv_dim)
        pk, pv = c.backend.install(k.reshape(flat), v.reshape(flat), c.layout,
                                   Ring(ring.capacity, ring.len, start, 0, ring.layer),
                                   tuple(c.keys.shape))
        meta = list(c.meta_state)
        meta[10] = "0"
        cache[i] = muser_kv.MuseKVCache.from_state((pk, pv), tuple(meta))
    muser_kv.caches.cachelist.bind(cache)
    return cache


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("tag,position", [("good", FIRST), ("second", SECOND)])
def test_decode_after_the_handoff_is_bitwise_one_process(exact, model, tag, position):
    """Rank 0 prefilled ``position`` tokens (past the wrap) and handed the session
    over; rank 1 decoded CONTINUE tokens: the logits of one process that
    prefilled and decoded itself, bit for bit (the second into a cache that
    had just refused four sessions)."""
    folder, sender, receiver, logs = exact
    assert sender[tag]["ok"] == position and receiver[tag]["ok"] == position, logs
    tokens = PROMPT[position:position + CONTINUE].tolist()
    alone = decode(model, prefill(model, PROMPT[:position].tolist()), tokens)
    got = np.load(folder / f"{tag}.npy")
    assert same_bits(got, alone), f"max |diff| {np.abs(got - alone).max()}"
    assert position > KW["sliding_window"] and position % KW["sliding_window"]
    # the control: with MLX's attention, which reads a ring in its physical order,
    # the rows packed from row 0 give other bits (muser-kv's reads them in logical
    # order, so a rotation cannot show there)
    muser_kv.set_decode_attention("mlx")
    try:
        cache = prefill(model, PROMPT[:position].tolist())
        as_is = decode(model, cache, tokens)
        packed = decode(model, packed_at_zero(prefill(model, PROMPT[:position].tolist())), tokens)
    finally:
        muser_kv.set_decode_attention("muser")
    assert not same_bits(packed, as_is), "this position does not tell rotations apart"


def refusal(exact, tag):
    _, sender, receiver, logs = exact
    return sender[tag], receiver[tag], logs


def test_a_tensor_flipped_in_transit_is_refused_and_the_receiver_unchanged(exact):
    sent, got, logs = refusal(exact, "tensor_flipped")
    assert got["error"] == "PayloadError" and "SessionFileError" in got["classes"], logs
    assert "corrupted tensor 'layers.2.keys' (checksum mismatch): sha256 expected" in got["message"]
    assert got["unchanged"] is True
    assert sent["error"] == "HandoffRefused"
    assert sent["message"].startswith("rank 1 refused the session: PayloadError: session from "
                                      "rank 0: corrupted tensor 'layers.2.keys'")


def test_a_header_flipped_in_transit_is_refused_and_the_receiver_unchanged(exact):
    sent, got, logs = refusal(exact, "header_flipped")
    assert got["error"] == "PayloadError", logs
    assert "corrupted header (checksum mismatch): header_sha256 expected" in got["message"]
    assert got["unchanged"] is True
    assert sent["error"] == "HandoffRefused" and "corrupted header" in sent["message"]


def test_another_geometry_is_refused_and_the_receiver_unchanged(exact):
    sent, got, logs = refusal(exact, "other_geometry")
    assert got["error"] == "SnapshotMismatch", logs
    assert got["message"] == ("session snapshot: geometry.max_context (expected: the "
                              "receiver's; got: the session from rank 0) expected 64, got 128")
    assert got["unchanged"] is True
    assert sent["error"] == "HandoffRefused" and "geometry.max_context" in sent["message"]


def test_another_model_is_refused_and_the_receiver_unchanged(exact):
    sent, got, logs = refusal(exact, "other_model")
    assert got["error"] == "ModelMismatch", logs
    assert got["message"].startswith("session snapshot: model fingerprint weights (the session "
                                     "was saved from another model than the receiving model")
    assert got["unchanged"] is True
    assert sent["error"] == "HandoffRefused" and "ModelMismatch" in sent["message"]


def test_a_receive_refuses_through_the_restore_gate(exact):
    """Another geometry and another model are refused by the one restore gate
    (``restore.check_session``) that loads, installs and store rebuilds take,
    with the error they raise (``test_restore_path.py``)."""
    for tag, error in (("other_geometry", "SnapshotMismatch"), ("other_model", "ModelMismatch")):
        _, got, logs = refusal(exact, tag)
        assert got["error"] == error and got["gate"] == [error], (tag, got, logs)


def test_a_receive_a_load_a_rebuild_and_an_install_of_one_state_are_one_list(exact, model,
                                                                              tmp_path):
    """The list a receive built is the list a session load, a KV-store rebuild
    and a snapshot install build for the same state: every plane bitwise equal
    in its allocated shape, every ring the same."""
    folder, _, _, logs = exact
    with np.load(folder / "good-planes.npz") as f:
        received = [f[f"arr_{i}"] for i in range(len(f.files))]
    rings = [tuple(r) for r in json.loads((folder / "good-rings.json").read_text())]
    live = prefill(model, PROMPT[:FIRST].tolist())
    path = tmp_path / "s.safetensors"
    muser_kv.save_session(path, live)
    store = muser_kv.KVStore()
    store.put(PROMPT[:FIRST].tolist(), live)
    n, rebuilt = store.longest_prefix(PROMPT[:FIRST + 1].tolist(), model)
    assert n == FIRST
    installed = muser_kv.make_prompt_cache(model)
    muser_kv.SessionSnapshot.capture(live).install(installed)
    for kind, cache in (("load", muser_kv.load_session(path, model)), ("rebuild", rebuilt),
                        ("install", installed)):
        planes = [np.array(a.view(mx.uint16)) for c in cache for a in c.kv_state]
        assert [c.meta_state for c in cache] == rings, kind
        assert len(planes) == len(received), kind
        for i, (got, want) in enumerate(zip(planes, received)):
            assert got.shape == want.shape and np.array_equal(got, want), (kind, i // 2)


def test_bytes_out_of_step_break_the_link_on_both_sides(exact, request):
    """A preamble that fails its framing cannot be skipped (its length is not
    known): both ranks say so, and every later call refuses at once. On
    collectives the sender learns it from the next message's descriptor (the
    receiver answers where the sender sends the header), which no collective
    of mismatched size follows."""
    sent, got, logs = refusal(exact, "preamble_flipped")
    assert got["error"] == "StreamOutOfStep" and "fails its CRC32" in got["message"], logs
    assert sent["error"] == "StreamOutOfStep" and "out of step" in sent["message"]
    if request.node.callspec.params["exact"] == "collective":
        assert sent["message"].startswith("rank 1 sends a message of ")
        assert "where this rank sends one of" in sent["message"]
    for report in exact[1:3]:
        assert report["after_break"]["error"] == "LinkBroken"
        assert report["after_break"]["seconds"] < 1.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sender_killed_mid_transfer_is_a_clear_error_and_the_receiver_unchanged(tmp_path,
                                                                                  transport):
    codes, (_, receiver), logs = run("kill", tmp_path, transport)
    assert codes[0] == -9 and codes[1] == 0, logs
    got = receiver["recv"]
    assert got["error"] == "PeerLost" and "ConnectionError" in got["classes"], logs
    assert got["message"].startswith(f"rank 0 went away during {MIDWAY}"), got["message"]
    assert got["seconds"] < handoff.DEFAULT_TIMEOUT
    assert got["unchanged"] is True
    assert receiver["again"]["error"] == "LinkBroken"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sender_silent_mid_transfer_times_out_and_the_receiver_unchanged(tmp_path, transport):
    """Rank 0 stops half-way, alive: rank 1 gives up after STALL_TIMEOUT seconds
    of silence; rank 0, going on once rank 1 has left, hears that it is gone
    (on collectives, the ring backend may not report it: then the bound does)."""
    codes, (sender, receiver), logs = run("stall", tmp_path, transport)
    assert codes == [0, 0], logs
    got = receiver["recv"]
    assert got["error"] == "HandoffTimeout" and "TimeoutError" in got["classes"], logs
    assert got["message"] == (f"nothing from rank 0 for {STALL_TIMEOUT:g} s while waiting "
                              f"for {MIDWAY} ({FIRST} rows); the link is broken")
    assert STALL_TIMEOUT <= got["seconds"] < STALL_TIMEOUT + 10
    assert got["unchanged"] is True
    assert receiver["again"]["error"] == "LinkBroken"
    if transport == "collective" and sender["send"]["error"] == "HandoffTimeout":
        assert f"for {STALLED_SENDER_TIMEOUT:g} s" in sender["send"]["message"], sender
    else:
        assert sender["send"]["error"] == "PeerLost", sender


def test_peer_ranks_outside_the_group_are_refused(model):
    group = mx.distributed.init(backend="ring")  # no MLX_RANK here: a group of one
    cache = muser_kv.make_prompt_cache(model)
    with pytest.raises(ValueError, match=r"peer rank expected another rank of the group"):
        handoff.send_session(cache, 0, group)
    with pytest.raises(ValueError, match=r"peer rank expected another rank"):
        handoff.recv_session(model, 1, group)
    with pytest.raises(TypeError, match="peer rank must be an int"):
        handoff.recv_session(model, True, group)


class ThreeRanks:
    """What a handoff asks of a group before any transfer, of a group of three."""

    def rank(self):
        return 0

    def size(self):
        return 3


def test_the_collective_transport_refuses_a_group_of_more_than_two(model):
    cache = muser_kv.make_prompt_cache(model)
    with pytest.raises(ValueError, match=r"collective transport expected a group of 2 ranks "
                                         r".*got 3; make one of the two ranks with group.split"):
        handoff.send_session(cache, 1, ThreeRanks(), transport="collective")
    with pytest.raises(ValueError, match=r"collective transport expected a group of 2 ranks"):
        handoff.recv_session(model, 2, ThreeRanks(), transport="collective")


def test_an_unknown_transport_is_refused(model):
    cache = muser_kv.make_prompt_cache(model)
    group = ThreeRanks()
    for transport in ("nccl", None, 2):
        with pytest.raises(ValueError, match=r"transport expected one of \['auto', 'p2p', "
                                             rf"'collective'\], got {transport!r}"):
            handoff.send_session(cache, 1, group, transport=transport)


def test_auto_is_the_collective_transport_in_a_process_launched_for_nccl(model, monkeypatch):
    """``mlx.launch --backend nccl``'s variables with CUDA: ``auto`` carries the
    handoff on collectives (here: refused on three ranks, as collectives are)."""
    cache = muser_kv.make_prompt_cache(model)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    for name, value in (("NCCL_HOST_IP", "127.0.0.1"), ("NCCL_PORT", "12345"),
                        ("MLX_WORLD_SIZE", "3")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"collective transport expected a group of 2 ranks"):
        handoff.send_session(cache, 1, ThreeRanks())


@pytest.mark.skipif(bool(os.environ.get(EMULATOR_ENV)),
                    reason="the emulated-Metal run cannot route mlx.launch's children through the "
                           "emulator (the handoff itself runs emulated in the other tests)")
def test_the_example_under_mlx_launch_decodes_what_one_process_does(tmp_path):
    launcher = shutil.which("mlx.launch", path=str(Path(sys.executable).parent))
    if launcher is None:
        pytest.skip("mlx.launch is not installed beside this Python")
    args = [launcher, "-n", "2", "--backend", "ring", "--python", sys.executable,
            "-p", str(launch_port()), str(ROOT / "examples" / "disaggregated.py"),
            "--check", "--conversations", "2", "--tokens", "6"]
    proc = subprocess.Popen(args, cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # mlx.launch and the two ranks it started
            proc.wait()
    assert proc.returncode == 0, out
    for n in (1, 2):
        assert f"[prefill] conversation {n}:" in out, out
        assert (f"[decode]  conversation {n}: from position" in out), out
    assert out.count("one process alone: the same tokens and logprob bits") == 2, out
