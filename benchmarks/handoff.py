"""How fast does a session go from one process to another, and how soon does the receiver decode?

A session sent with ``muser_kv.handoff`` against a raw send/recv of its bytes,
and the receiver's time to first token against ``load_session`` and a
re-prefill. Two ranks of an MLX ring group on this host (started through
``mlx.launch -n 2 --backend ring`` when run plainly, with this checkout on their
``PYTHONPATH``) share a Muse-shaped model (``_harness.build_model``, one seed;
by default the real KV geometry and window, 8 layers, hidden 64). Per depth D,
rank 0 prefills D random tokens (``--chunk`` at a time) into a muser-kv cache;
then every repeat, from a common start (a one-byte message each way), the
handoff and the raw transfer take turns, the order flipped every repeat:

1. **Throughput.** ``handoff``: rank 0 ``send_session(cache, 1)`` (cut, sha256 of
   every tensor, header, stream), rank 1 ``recv_session(model, 0)`` (verify the
   header, allocate, verify each tensor and install it), timed on rank 1 to the
   installed cache. ``raw``: the same tensors (already cut), one
   ``mx.distributed.send`` each, received and evaluated: the floor for these
   bytes between these processes. GB = 1e9 B of tensor payload.
2. **Time to first token on rank 1** (the logits of token D, evaluated): the
   handoff then one decode step; ``load_session`` of the same session from a
   file in the page cache, then one step; a re-prefill of the D tokens, then
   one step (``--prefill-repeats`` times, no untimed round). The last two run
   after rank 0 has left, and rank 0 sleeps ``--settle`` s after each send
   (MLX's ring backend busy-polls a posted receive), so that nothing shares the
   cores with them. The three logits must be equal, bit for bit (exit 1 if not).
3. **Where the time goes**: the handoff's parts, one at a time on rank 1
   (fingerprint, cut, sha256, allocate, install), their serial sum with the raw
   transfer beside the handoff's time.

The re-prefill's model is tiny: a real Muse Glimmer spends far more per
prefilled token, so the re-prefill column is a lower bound there.

``--backend nccl`` (two CUDA GPUs): the ranks are an NCCL group, which has no
send/recv; the handoff runs with ``transport="collective"`` and the raw
transfer, the common start and the timings go as the same collectives (each
message one ``all_sum`` of its bytes, the receiver's zeros added).

    python3 benchmarks/handoff.py --depths 2048,8192,32768 --layers 52    # H200 (not run there)
    python3 benchmarks/handoff.py --backend nccl --depths 2048,32768      # two GPUs, NCCL
    PYTHONPATH=. .venv/bin/python benchmarks/handoff.py                   # CPU: depths 512, 2048
    PYTHONPATH=. .venv/bin/python benchmarks/handoff.py --depths 256,512 --repeats 2 --settle 0.2
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Sequence

import _harness as H
import mlx.core as mx
import numpy as np

import muser_kv
from muser_kv.sessions import handoff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--depths", type=H.int_list, default=[512, 2048],
                   help="session depths in positions (default 512,2048; 'k' suffix allowed)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--prefill-repeats", type=int, default=1,
                   help="timed re-prefills per depth (default 1: on a CPU they take a while)")
    p.add_argument("--backend", choices=("ring", "nccl"), default="ring",
                   help="the MLX backend of the two ranks (default ring; nccl: two CUDA GPUs, "
                        "the handoff on collectives)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds rank 0 sleeps after each send before it waits again (default 1)")
    H.add_flags(p, ("layers", "hidden", "vocab", "heads", "window"),
                defaults=dict(layers=8, hidden=64, vocab=256, heads=4),
                blocks=("repeats", 3, "timed repeats per cell, after one untimed; the median"))
    args = H.parse(p, argv)
    if min(args.depths) < 1 or min(args.layers, args.repeats, args.chunk,
                                    args.prefill_repeats) < 1:
        p.error("--depths, --layers, --repeats, --prefill-repeats and --chunk must be positive")
    return args


# -- the two processes ------------------------------------------------------------------


def launch(argv: Sequence[str], backend: str) -> int:
    """Run this script as ranks 0 and 1 with mlx.launch (ring: two consecutive free
    ports; NCCL: one, and a GPU per rank)."""
    launcher = shutil.which("mlx.launch", path=os.path.dirname(sys.executable))
    # where MLX's wheel was unpacked rather than installed there is no console
    # script: run what it runs
    run = [launcher] if launcher is not None else [
        sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; "
                              "sys.argv[0] = 'mlx.launch'; sys.exit(main())"]
    port = ["-p", str(H.launch_port())] if backend == "ring" else [
        "--nccl-port", str(H.launch_port())]
    cmd = [*run, "-n", "2", "--backend", backend, "--python", sys.executable, *port,
           os.path.abspath(__file__), *argv]
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}  # this checkout's muser_kv, in both ranks
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, env=env).returncode


def prefill(model, tokens: np.ndarray, chunk: int) -> List[Any]:
    cache = muser_kv.make_prompt_cache(model)
    for s in range(0, len(tokens), chunk):
        model(mx.array(tokens[None, s:s + chunk]), cache=cache)
        mx.eval([c.kv_state for c in cache])
    return cache


def first_token(model, cache, token: int) -> np.ndarray:
    """The logits of ``token`` decoded on ``cache``, evaluated (f32 numpy)."""
    logits = model(mx.array([[token]]), cache=cache)
    mx.eval(logits)
    return np.array(logits[0, -1].astype(mx.float32))


def send_all(group, xs: Sequence[mx.array], dst: int, backend: str) -> None:
    """``xs`` to rank ``dst``: one send each, or (NCCL: no send/recv) one ``all_sum``
    of each one's bytes, to which the receiver adds zeros."""
    if backend == "ring":
        mx.eval([mx.distributed.send(x, dst, group=group) for x in xs])
    else:
        mx.eval([mx.distributed.all_sum(x.reshape(-1).view(mx.uint8), group=group) for x in xs])


def recv_all(group, specs: Sequence[Any], src: int, backend: str) -> List[mx.array]:
    """What ``send_all`` sends, by (shape, dtype), evaluated."""
    if backend == "ring":
        ys = [mx.distributed.recv(shape, dtype, src, group=group) for shape, dtype in specs]
    else:
        ys = [mx.distributed.all_sum(mx.zeros((int(np.prod(shape)) * dtype.size,), mx.uint8),
                                     group=group).view(dtype).reshape(shape)
              for shape, dtype in specs]
    mx.eval(ys)
    return ys


def barrier(group, rank: int, backend: str) -> None:
    """Both ready: rank 0 says it is, rank 1 answers; rank 1's clock starts when its
    answer is sent, rank 0's when it has it."""
    byte = mx.zeros((1,), mx.uint8)
    if rank == 0:
        send_all(group, [byte], 1, backend)
        recv_all(group, [((1,), mx.uint8)], 1, backend)
    else:
        recv_all(group, [((1,), mx.uint8)], 0, backend)
        send_all(group, [byte], 0, backend)


def transport(args) -> str:
    return "p2p" if args.backend == "ring" else "collective"


def tensors(cache) -> List[mx.array]:
    snap = muser_kv.SessionSnapshot.capture(cache)
    return [x for cut in snap.layers for x in (cut.keys, cut.values) if x.size]


def sender(group, model, args) -> None:
    rng = np.random.default_rng(args.seed)
    for depth in args.depths:
        prompt = rng.integers(0, args.vocab, depth + 1)
        cache = prefill(model, prompt[:depth], args.chunk)
        raw = tensors(cache)
        for r in range(args.repeats + 1):
            spent = 0.0
            for kind in H.order(r, ("handoff", "raw")):  # the order flipped every repeat
                barrier(group, 0, args.backend)
                if kind == "handoff":
                    t = H.now()
                    handoff.send_session(cache, 1, group, transport=transport(args))
                    spent = H.now() - t
                else:
                    send_all(group, raw, 1, args.backend)
                time.sleep(args.settle)
            send_all(group, [mx.array([spent], mx.float32)], 1, args.backend)
        del cache, raw
        H.settle()


def receiver(group, model, args, workdir: str) -> List[Dict[str, Any]]:
    rng = np.random.default_rng(args.seed)
    cells = []
    for depth in args.depths:
        prompt = rng.integers(0, args.vocab, depth + 1)
        cell: Dict[str, Any] = {"depth": depth, "handoff_s": [], "ttft_handoff_s": [],
                                "raw_s": [], "sender_s": [],
                                "file": os.path.join(workdir, f"session-{depth}.safetensors")}
        for r in range(args.repeats + 1):  # the first round is untimed, the handoff first
            for kind in H.order(r, ("handoff", "raw")):
                H.settle()
                barrier(group, 1, args.backend)
                t = H.now()
                if kind == "handoff":
                    got = handoff.recv_session(model, 0, group, transport=transport(args))
                    installed = H.now() - t
                    if r == 0:  # the session as it came, for the raw shapes and the file
                        shapes = [(x.shape, x.dtype) for x in tensors(got.cache)]
                        muser_kv.save_session(cell["file"], got.cache, model=model)
                    cell["handoff_logits"] = first_token(model, got.cache, int(prompt[depth]))
                    ttft = H.now() - t
                    cell["nbytes"] = got.nbytes
                    del got
                else:
                    recv_all(group, shapes, 0, args.backend)
                    raw_s = H.now() - t
            spent = recv_all(group, [((1,), mx.float32)], 0, args.backend)[0].item()
            if r:
                for key, value in (("handoff_s", installed), ("ttft_handoff_s", ttft),
                                   ("raw_s", raw_s), ("sender_s", spent)):
                    cell[key].append(value)
        cells.append(cell)
    return cells


def local(model, cells: List[Dict[str, Any]], args) -> None:
    """Rank 1 alone: the same first token from a session file and from a re-prefill,
    and the handoff's parts one at a time."""
    from muser_kv.sessions import format as snapshot

    rng = np.random.default_rng(args.seed)
    for cell in cells:
        depth = cell["depth"]
        prompt = rng.integers(0, args.vocab, depth + 1)
        path = cell.pop("file")
        for key in ("ttft_file_s", "ttft_prefill_s", "fingerprint_s", "capture_s", "sha256_s",
                    "allocate_s", "install_s"):
            cell[key] = []
        for r in range(args.repeats + 1):
            H.settle()
            t = H.now()
            restored = muser_kv.load_session(path, model)
            file_logits = first_token(model, restored, int(prompt[depth]))
            file_s = H.now() - t
            if r:
                cell["ttft_file_s"].append(file_s)
        session = muser_kv.load_session(path, model)
        for r in range(args.repeats + 1):
            H.settle()
            parts: Dict[str, float] = {}
            with H.clock(parts, "fingerprint_s"):
                muser_kv.model_fingerprint(model)
            with H.clock(parts, "capture_s"):
                snap = muser_kv.SessionSnapshot.capture(session)
            arrays = {f"{i}.{j}": np.asarray(x) for i, c in enumerate(snap.layers)
                      for j, x in enumerate((c.keys, c.values))}
            with H.clock(parts, "sha256_s"):
                snapshot.tensor_digests(arrays)
            with H.clock(parts, "allocate_s"):
                fresh = muser_kv.make_prompt_cache(model, snap.geometry.max_context)
                mx.eval([c.kv_state for c in fresh])
            with H.clock(parts, "install_s"):
                muser_kv.restore_into(fresh, snap)
                mx.eval([c.kv_state for c in fresh])
            if r:
                for key, value in parts.items():
                    cell[key].append(value)
            del snap, arrays, fresh
        del session
        for _ in range(args.prefill_repeats):
            H.settle()
            t = H.now()
            prefill_logits = first_token(model, prefill(model, prompt[:depth], args.chunk),
                                         int(prompt[depth]))
            cell["ttft_prefill_s"].append(H.now() - t)
        ref = cell.pop("handoff_logits")
        cell["same_logits"] = bool(np.array_equal(ref.view(np.uint32), file_logits.view(np.uint32))
                                   and np.array_equal(ref.view(np.uint32),
                                                      prefill_logits.view(np.uint32)))


def report(cells: List[Dict[str, Any]], args) -> None:
    H.print_header("Handoff between processes: muser_kv.handoff against raw send/recv, and the "
                   "receiver's first token against load_session and a re-prefill", args,
                   ("two ranks of an MLX ring group on one host (loopback TCP); "
                    if args.backend == "ring" else
                    "two ranks of an MLX NCCL group, one GPU each, the handoff on collectives; ")
                   + f"median of {args.repeats} repeats after one untimed")
    rows = []
    for c in cells:
        hand, raw = H.median(c["handoff_s"]), H.median(c["raw_s"])
        rows.append([c["depth"], c["nbytes"] / H.MIB, raw * 1e3, hand * 1e3,
                     H.median(c["sender_s"]) * 1e3, c["nbytes"] / raw / H.GB,
                     c["nbytes"] / hand / H.GB, raw / hand])
    H.table(["depth", "payload MiB", "raw ms", "handoff ms", "rank 0 in send_session ms",
             "raw GB/s", "handoff GB/s", "raw / handoff"], rows,
            title="Throughput (handoff: rank 0's send_session start -> rank 1's cache installed; "
                  "raw: the same tensors, send/recv only, or NCCL's all_sum only)")
    rows = []
    for c in cells:
        hand, f, pre = (H.median(c[k]) for k in ("ttft_handoff_s", "ttft_file_s", "ttft_prefill_s"))
        rows.append([c["depth"], hand * 1e3, f * 1e3, pre * 1e3, f / hand, pre / hand,
                     "yes" if c["same_logits"] else "NO"])
    H.table(["depth", "handoff ms", "load_session ms", "re-prefill ms", "load_session / handoff",
             "re-prefill / handoff", "same logits bits"], rows,
            title="Time to the first decoded token on rank 1 (ratio > 1: the handoff is faster)")
    rows = []
    for c in cells:
        parts = [H.median(c[k]) * 1e3 for k in ("fingerprint_s", "capture_s", "sha256_s",
                                               "allocate_s", "install_s")]
        fingerprint, capture, sha, allocate, install = parts
        serial = capture + sha + H.median(c["raw_s"]) * 1e3 + fingerprint + sha + allocate + install
        rows.append([c["depth"], *parts, H.median(c["raw_s"]) * 1e3, serial,
                     H.median(c["handoff_s"]) * 1e3])
    H.table(["depth", "fingerprint ms", "capture ms", "sha256 ms", "allocate ms", "install ms",
             "raw ms", "serial sum ms", "handoff ms"], rows,
            title="Where a handoff's time goes: its parts timed one at a time on rank 1 (capture "
                  "includes the sender's fingerprint; each side hashes every tensor once; serial "
                  "= capture + sha256 + raw + fingerprint + sha256 + allocate + install)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "MLX_RANK" not in os.environ:
        return launch(argv, args.backend)
    group = mx.distributed.init(backend=args.backend, strict=True)
    if group.size() != 2:
        raise SystemExit(f"handoff.py needs 2 ranks, got {group.size()}")
    model = H.build_model(args, intermediate_size=2 * args.hidden,
                          max_position_embeddings=max(args.depths) + 256)
    if group.rank() == 0:
        sender(group, model, args)
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        cells = receiver(group, model, args, workdir)
        local(model, cells, args)
    report(cells, args)
    H.write_json(args.json, {"benchmark": "handoff", "args": vars(args), "cells": cells})
    return 0 if all(c["same_logits"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
