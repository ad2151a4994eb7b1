"""A rank of tests/sessions/test_handoff.py's two-process runs:
``handoff_child.py SCENARIO FOLDER [TRANSPORT]`` (the handoff's ``transport``,
default ``"auto"``: ``"p2p"`` on this ring group).

Rank 0 prefills and sends, rank 1 receives; each writes what it saw to
``FOLDER/rank{r}.json`` (and logits to ``.npy`` files) for the test to judge.

* ``exact``: a session past the ring wrap, then a flipped tensor bit, a
  flipped header bit, a receiver of another geometry, of another model, a
  second good session into the refusals' cache, and last a flipped preamble
  (the link breaks).
* ``kill``: rank 0 kills itself (SIGKILL) half-way through the tensors.
* ``stall``: rank 0 stops sending half-way (alive, silent) until rank 1 has
  given up and exited; then it tries to go on.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from conftest import tiny_model
from ring_pair import INIT_FAILED

import muser_kv
from muser_kv.sessions import handoff, restore, wire

KW = dict(sliding_window=16, max_position_embeddings=128)
PROMPT = np.random.default_rng(7).integers(0, 256, 80)
#: The handed-over positions: both past the ring wrap (window 16), other rotations.
FIRST, SECOND = 43, 58
CHUNK = 7
CONTINUE = 8
STALL_TIMEOUT = 2.0
#: The stalled sender's bound, once it goes on after the receiver left (the ring
#: backend's collectives can miss a peer gone mid-collective: then the bound ends it).
STALLED_SENDER_TIMEOUT = 10.0
#: The tensor whose turn the kill and the stall come at (layers 0-2 have gone by then).
MIDWAY = "layers.3.keys"
#: Every handoff call's ``transport`` (main sets it from the command line).
TRANSPORT = "auto"


def send(*args, **kw):
    return handoff.send_session(*args, transport=TRANSPORT, **kw)


def recv(*args, **kw):
    return handoff.recv_session(*args, transport=TRANSPORT, **kw)


def prefill(model, tokens, cache=None):
    """``tokens`` through the model in chunks of CHUNK (the rings wrap inside chunks)."""
    cache = cache if cache is not None else muser_kv.make_prompt_cache(model)
    for s in range(0, len(tokens), CHUNK):
        model(mx.array([tokens[s:s + CHUNK]]), cache=cache)
    mx.eval([c.kv_state for c in cache])
    return cache


def decode(model, cache, tokens):
    """Logits (f32 numpy) of each of ``tokens`` decoded one at a time."""
    out = []
    for t in tokens:
        logits = model(mx.array([[int(t)]]), cache=cache)
        out.append(np.array(logits[0, -1].astype(mx.float32)))
    return np.stack(out)


def bits(cache):
    """Everything a restore could change: every plane's bits and every ring."""
    planes = [np.array(a.view(mx.uint16)) for c in cache for a in c.kv_state]
    return planes, [c.meta_state for c in cache]


def unchanged(before, cache):
    planes, rings = bits(cache)
    return rings == before[1] and all(np.array_equal(a, b) for a, b in zip(planes, before[0]))


def flip(target, bit=3):
    """Make ``wire.outgoing`` flip one bit of the message named ``target``, once."""
    def corrupt(name, x):
        if name != target:
            return x
        wire.outgoing = lambda n, y: y
        data = np.array(x.view(mx.uint8)).reshape(-1).copy()
        data[len(data) // 2] ^= 1 << bit
        return mx.array(data).view(x.dtype).reshape(x.shape)
    wire.outgoing = corrupt


def outcome(call):
    """``{"ok": ...}`` or ``{"error": class name, "message", "seconds"}``."""
    t = time.monotonic()
    try:
        return {"ok": call(), "seconds": time.monotonic() - t}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t,
                "classes": [k.__name__ for k in type(e).__mro__]}


def exact_sender(group, model, folder):
    out = {}
    cache = prefill(model, PROMPT[:FIRST].tolist())
    nxt = PROMPT[FIRST:FIRST + CONTINUE].tolist()
    out["good"] = outcome(lambda: send(cache, 1, group,
                                                       metadata={"next": nxt}).position)
    flip("layers.2.keys")
    out["tensor_flipped"] = outcome(lambda: send(cache, 1, group).position)
    flip("header")
    out["header_flipped"] = outcome(lambda: send(cache, 1, group).position)
    out["other_geometry"] = outcome(lambda: send(cache, 1, group).position)
    out["other_model"] = outcome(lambda: send(cache, 1, group).position)
    second = prefill(model, PROMPT[:SECOND].tolist())
    nxt = PROMPT[SECOND:SECOND + CONTINUE].tolist()
    out["second"] = outcome(lambda: send(second, 1, group,
                                                         metadata={"next": nxt}).position)
    flip("preamble")
    out["preamble_flipped"] = outcome(lambda: send(cache, 1, group).position)
    out["after_break"] = outcome(lambda: send(cache, 1, group).position)
    return out


def gated(refusals):
    """Make the restore gate's ``check_session`` append each refusal's class name
    to ``refusals``: which refusals the one gate raised."""
    real = restore.check_session

    def check_session(*a, **k):
        try:
            return real(*a, **k)
        except Exception as e:
            refusals.append(type(e).__name__)
            raise
    restore.check_session = check_session


def exact_receiver(group, model, folder):
    out = {}
    refusals = []
    gated(refusals)

    def take(tag, receiving=model, **kw):
        r = recv(receiving, 0, group, **kw)
        planes, rings = bits(r.cache)  # the list as received, before it decodes
        np.savez(folder / f"{tag}-planes.npz", *planes)
        (folder / f"{tag}-rings.json").write_text(json.dumps(rings))
        np.save(folder / f"{tag}.npy", decode(receiving, r.cache, r.metadata["next"]))
        return r.position

    out["good"] = outcome(lambda: take("good"))
    into = prefill(model, PROMPT[3:30].tolist())  # a session of its own, wrapped
    before = bits(into)

    def refused(tag, receiving=model, cache=into, state=before):
        refusals.clear()
        out[tag] = outcome(lambda: recv(receiving, 0, group, into=cache).position)
        out[tag]["unchanged"] = unchanged(state, cache)
        out[tag]["gate"] = list(refusals)

    refused("tensor_flipped")
    refused("header_flipped")
    shorter = prefill(model, PROMPT[:20].tolist(), muser_kv.make_prompt_cache(model, 64))
    refused("other_geometry", cache=shorter, state=bits(shorter))
    other = tiny_model(mx.float16, seed=1, **KW)
    theirs = prefill(other, PROMPT[:25].tolist())
    refused("other_model", receiving=other, cache=theirs, state=bits(theirs))
    out["second"] = outcome(lambda: take("second", into=into))
    out["preamble_flipped"] = outcome(lambda: recv(model, 0, group).position)
    out["after_break"] = outcome(lambda: recv(model, 0, group).position)
    return out


def midway(action):
    """Make ``wire.outgoing`` run ``action`` when MIDWAY's turn comes."""
    def hook(name, x):
        if name == MIDWAY:
            action()
        return x
    wire.outgoing = hook


def kill_sender(group, model, folder):
    cache = prefill(model, PROMPT[:FIRST].tolist())

    def die():
        time.sleep(0.5)  # layers 0-2 go out meanwhile
        os.kill(os.getpid(), signal.SIGKILL)
    midway(die)
    send(cache, 1, group)
    return {"sent": "unexpectedly"}


def stall_sender(group, model, folder):
    cache = prefill(model, PROMPT[:FIRST].tolist())

    def stall():
        deadline = time.monotonic() + 60
        while not (folder / "receiver-gone").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    midway(stall)
    return {"send": outcome(lambda: send(cache, 1, group,
                                         timeout=STALLED_SENDER_TIMEOUT).position)}


def bounded_receiver(timeout):
    def receive(group, model, folder):
        into = prefill(model, PROMPT[3:30].tolist())
        before = bits(into)
        out = {"recv": outcome(lambda: recv(model, 0, group, into=into,
                                                            timeout=timeout).position)}
        out["recv"]["unchanged"] = unchanged(before, into)
        out["again"] = outcome(lambda: recv(model, 0, group, into=into).position)
        return out
    return receive


def zoo_sender(group, model, folder):
    """Every zoo family's session (bf16, past the wrap), handed over in turn."""
    from model_zoo import tiny

    out = {}
    for name in zoo_names():
        m = tiny(name, mx.bfloat16)
        cache = muser_kv.make_prompt_cache(m, ZOO_CONTEXT)
        m(mx.array([ZOO_PROMPT]), cache=cache)
        out[name] = outcome(lambda cache=cache: send(cache, 1, group).position)
    return out


def zoo_receiver(group, model, folder):
    """Each family's session received into a new list, then ZOO_NEXT decoded."""
    from model_zoo import tiny

    out = {}
    for name in zoo_names():
        m = tiny(name, mx.bfloat16)

        def take(m=m, name=name):
            r = recv(m, 0, group)
            np.save(folder / f"zoo-{name}.npy", decode(m, r.cache, ZOO_NEXT))
            return r.position

        out[name] = outcome(take)
    return out


def zoo_names():
    """Every zoo family; Muse Spark on the stand-ins for mlx-lm's Metal kernels
    (``mlx_lm_kernels``) where this process has no Metal, as in the test's own."""
    import mlx_lm_kernels
    from model_zoo import ZOO

    mlx_lm_kernels.install()
    return list(ZOO)


#: the zoo scenario's session: 21 tokens through windows of 8, then 4 decoded
ZOO_PROMPT = [(5 * i) % 100 + 1 for i in range(21)]
ZOO_NEXT = [3, 9, 27, 81]
ZOO_CONTEXT = 96


SCENARIOS = {
    "exact": (exact_sender, exact_receiver),
    "zoo": (zoo_sender, zoo_receiver),
    "kill": (kill_sender, bounded_receiver(handoff.DEFAULT_TIMEOUT)),
    "stall": (stall_sender, bounded_receiver(STALL_TIMEOUT)),
}


def main(scenario, folder, transport="auto"):
    global TRANSPORT
    TRANSPORT = transport
    folder = Path(folder)
    try:
        group = mx.distributed.init(backend="ring", strict=True)
    except RuntimeError as e:
        print(f"ring init failed: {e}", file=sys.stderr)
        sys.exit(INIT_FAILED)
    rank = group.rank()
    model = tiny_model(mx.float16, **KW)
    result = SCENARIOS[scenario][rank](group, model, folder)
    (folder / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    if rank == 1:
        (folder / "receiver-gone").write_text("")
    # Not the interpreter's shutdown: a courier blocked on a broken link that MLX
    # completes during it would abort the process (handoff.py, "Limits").
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
