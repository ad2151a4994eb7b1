"""Handoff between processes: a session sent with muser_kv's handoff against the raw
bytes, and the decode side's time to first token against a file and a re-prefill.

Two processes (ranks 0 and 1 of an MLX ring group on this host; the script
starts them through ``mlx.launch -n 2 --backend ring`` when run plainly) share a
Muse-shaped model (random weights, the same seed: real KV geometry 2 x 128,
``--layers`` layers, ``--window``, tiny hidden size). For each depth D, rank 0
prefills D random tokens (``--chunk`` at a time) into a muser-kv cache, then,
every repeat, from a common start (a one-byte message from rank 1):

1. **Throughput.** ``handoff``: rank 0 ``send_session(cache, 1)`` (cut, sha256
   of every tensor, header, stream), rank 1 ``recv_session(model, 0)`` (verify
   the header, allocate a cache, verify each tensor's sha256 and install it);
   timed on rank 1 from the start to the installed cache. ``raw``: the same
   tensors (the session's rows, already cut) with one ``mx.distributed.send``
   each, received with ``recv`` and evaluated: the floor for these bytes
   between these two processes. GB = 1e9 B of tensor payload.
2. **Time to first token on rank 1** (the logits of token D, evaluated):
   ``handoff`` as above, then one decode step; ``load_session`` of the same
   session from a file on local disk (written once beforehand, in the page
   cache) then one step; a re-prefill of the D tokens in a fresh cache, then
   one step (``--prefill-repeats`` times, no untimed round: on a CPU it is
   slow). The last two run after rank 0 has left, so that nothing shares the
   cores with them; rank 0 sleeps ``--settle`` seconds after each send for
   the same reason (MLX's ring backend busy-polls a posted receive). The
   three first tokens' logits must be equal, bit for bit (exit status 1
   otherwise).
3. **Where the time goes.** The handoff's parts, one at a time on rank 1:
   the model fingerprint, the cut (``SessionSnapshot.capture``, which takes
   the sender's fingerprint), sha256 of every tensor (each side does it once),
   allocating the receiver's cache, installing the rows; their serial sum
   with the raw transfer, beside the handoff's measured time.

The re-prefill's model is tiny (hidden 64): a real Muse Glimmer spends far
more per prefilled token, so the re-prefill column is a lower bound there.

    python benchmarks/handoff.py                       # CPU: depths 512, 2048, 8 layers
    python benchmarks/handoff.py --depths 2048,8192,32768 --layers 52
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's muser_kv, in both ranks

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    int_list,
    launch_port,
    median,
    now,
    print_header,
    print_table,
    settle,
    write_json,
)

import muser_kv  # noqa: E402
from muser_kv.sessions import handoff  # noqa: E402

GB = 1e9
MIB = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int_list, default=[512, 2048],
                   help="session depths in positions (default 512,2048; 'k' suffix allowed)")
    p.add_argument("--layers", type=int, default=8, help="layers, i %% 4 == 3 global (default 8)")
    p.add_argument("--window", type=int, default=2048, help="sliding window (default 2048)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats per cell, after one untimed; the median is shown (default 3)")
    p.add_argument("--prefill-repeats", type=int, default=1,
                   help="timed re-prefills per depth (default 1: on a CPU they take a while)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds rank 0 sleeps after each send before it waits again (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write all measurements as JSON (rank 1)")
    args = p.parse_args(argv)
    if min(args.depths) < 1 or min(args.layers, args.repeats, args.chunk,
                                    args.prefill_repeats) < 1:
        p.error("--depths, --layers, --repeats, --prefill-repeats and --chunk must be positive")
    return args


# -- the two processes ------------------------------------------------------------------


def launch(argv: Sequence[str]) -> int:
    """Run this script as ranks 0 and 1 with mlx.launch (two consecutive free ports)."""
    launcher = shutil.which("mlx.launch", path=os.path.dirname(sys.executable))
    if launcher is None:
        raise SystemExit("handoff.py: mlx.launch not found beside this Python; run it as "
                         "mlx.launch -n 2 --backend ring --python PY benchmarks/handoff.py")
    port = launch_port()
    cmd = [launcher, "-n", "2", "--backend", "ring", "--python", sys.executable, "-p", str(port),
           os.path.abspath(__file__), *argv]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode


def build_model(args: argparse.Namespace):
    from mlx_lm.models import muse_glimmer

    margs = muse_glimmer.ModelArgs(
        hidden_size=args.hidden, num_hidden_layers=args.layers,
        intermediate_size=2 * args.hidden, num_attention_heads=args.heads,
        num_key_value_heads=2, head_dim=128, vocab_size=256, sliding_window=args.window,
        max_position_embeddings=max(args.depths) + 256)
    mx.random.seed(args.seed)
    model = muse_glimmer.Model(margs)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


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


def barrier(group, rank: int) -> None:
    """Both ready: rank 0 says it is, rank 1 answers; rank 1's clock starts when its
    answer is sent, rank 0's when it has it."""
    byte = mx.zeros((1,), mx.uint8)
    if rank == 0:
        mx.eval(mx.distributed.send(byte, 1, group=group))
        mx.eval(mx.distributed.recv((1,), mx.uint8, 1, group=group))
    else:
        mx.eval(mx.distributed.recv((1,), mx.uint8, 0, group=group))
        mx.eval(mx.distributed.send(byte, 0, group=group))


def tensors(cache) -> List[mx.array]:
    snap = muser_kv.SessionSnapshot.capture(cache)
    return [x for cut in snap.layers for x in (cut.keys, cut.values) if x.size]


def sender(group, model, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    for depth in args.depths:
        prompt = rng.integers(0, 256, depth + 1)
        cache = prefill(model, prompt[:depth], args.chunk)
        raw = tensors(cache)
        for _ in range(args.repeats + 1):
            barrier(group, 0)
            t = now()
            handoff.send_session(cache, 1, group)
            spent = now() - t
            time.sleep(args.settle)
            barrier(group, 0)
            mx.eval([mx.distributed.send(x, 1, group=group) for x in raw])
            mx.eval(mx.distributed.send(mx.array([spent], mx.float32), 1, group=group))
            time.sleep(args.settle)
        del cache, raw
        settle()


def receiver(group, model, args: argparse.Namespace, workdir: str) -> List[Dict[str, Any]]:
    rng = np.random.default_rng(args.seed)
    cells = []
    for depth in args.depths:
        prompt = rng.integers(0, 256, depth + 1)
        cell: Dict[str, Any] = {"depth": depth, "handoff_s": [], "ttft_handoff_s": [],
                                "raw_s": [], "sender_s": [],
                                "file": os.path.join(workdir, f"session-{depth}.safetensors")}
        for r in range(args.repeats + 1):
            settle()
            barrier(group, 1)
            t = now()
            got = handoff.recv_session(model, 0, group)
            installed = now() - t
            if r == 0:  # untimed: the session as it came, for the raw shapes and the file
                shapes = [(x.shape, x.dtype) for x in tensors(got.cache)]
                muser_kv.save_session(cell["file"], got.cache, model=model)
            logits = first_token(model, got.cache, int(prompt[depth]))
            ttft = now() - t
            settle()
            barrier(group, 1)
            t = now()
            ys = [mx.distributed.recv(shape, dtype, 0, group=group) for shape, dtype in shapes]
            mx.eval(ys)
            raw_s = now() - t
            spent = mx.distributed.recv((1,), mx.float32, 0, group=group).item()
            if r:  # the first round is untimed
                cell["handoff_s"].append(installed)
                cell["ttft_handoff_s"].append(ttft)
                cell["raw_s"].append(raw_s)
                cell["sender_s"].append(spent)
            cell["nbytes"] = got.nbytes
            cell["handoff_logits"] = logits
            del ys, got
        cells.append(cell)
    return cells


def local(model, cells: List[Dict[str, Any]], args: argparse.Namespace) -> None:
    """Rank 1 alone: the same first token from a session file and from a re-prefill,
    and the handoff's parts one at a time."""
    from muser_kv.sessions import format as snapshot

    rng = np.random.default_rng(args.seed)
    for cell in cells:
        depth = cell["depth"]
        prompt = rng.integers(0, 256, depth + 1)
        path = cell.pop("file")
        for key in ("ttft_file_s", "ttft_prefill_s", "fingerprint_s", "capture_s", "sha256_s",
                    "allocate_s", "install_s"):
            cell[key] = []
        for r in range(args.repeats + 1):
            settle()
            t = now()
            restored = muser_kv.load_session(path, model)
            file_logits = first_token(model, restored, int(prompt[depth]))
            file_s = now() - t
            if r:
                cell["ttft_file_s"].append(file_s)
        session = muser_kv.load_session(path, model)
        for r in range(args.repeats + 1):
            settle()
            parts = {}
            t = now()
            muser_kv.model_fingerprint(model)
            parts["fingerprint_s"] = now() - t
            t = now()
            snap = muser_kv.SessionSnapshot.capture(session)
            parts["capture_s"] = now() - t
            arrays = {f"{i}.{j}": np.asarray(x) for i, c in enumerate(snap.layers)
                      for j, x in enumerate((c.keys, c.values))}
            t = now()
            snapshot.tensor_digests(arrays)
            parts["sha256_s"] = now() - t
            t = now()
            fresh = muser_kv.make_prompt_cache(model, snap.geometry.max_context)
            mx.eval([c.kv_state for c in fresh])
            parts["allocate_s"] = now() - t
            t = now()
            muser_kv.restore_into(fresh, snap)
            mx.eval([c.kv_state for c in fresh])
            parts["install_s"] = now() - t
            if r:
                for key, value in parts.items():
                    cell[key].append(value)
            del snap, arrays, fresh
        del session
        for _ in range(args.prefill_repeats):
            settle()
            t = now()
            prefill_logits = first_token(model, prefill(model, prompt[:depth], args.chunk),
                                         int(prompt[depth]))
            cell["ttft_prefill_s"].append(now() - t)
        ref = cell.pop("handoff_logits")
        cell["same_logits"] = bool(np.array_equal(ref.view(np.uint32), file_logits.view(np.uint32))
                                   and np.array_equal(ref.view(np.uint32),
                                                      prefill_logits.view(np.uint32)))


def report(cells: List[Dict[str, Any]], args: argparse.Namespace) -> None:
    print_header("Handoff between processes: muser_kv.handoff against raw send/recv, and the "
                 "receiver's first token against load_session and a re-prefill", args,
                 "two ranks of an MLX ring group on one host (loopback TCP); "
                 f"median of {args.repeats} repeats after one untimed")
    rows = []
    for c in cells:
        hand, raw = median(c["handoff_s"]), median(c["raw_s"])
        rows.append([c["depth"], c["nbytes"] / MIB, raw * 1e3, hand * 1e3,
                     median(c["sender_s"]) * 1e3, c["nbytes"] / raw / GB,
                     c["nbytes"] / hand / GB, raw / hand])
    print("Throughput (handoff: rank 0's send_session start -> rank 1's cache installed; "
          "raw: the same tensors, send/recv only)")
    print()
    print_table(["depth", "payload MiB", "raw ms", "handoff ms", "rank 0 in send_session ms",
                 "raw GB/s", "handoff GB/s", "raw / handoff"], rows)
    rows = []
    for c in cells:
        hand, f, pre = (median(c[k]) for k in ("ttft_handoff_s", "ttft_file_s", "ttft_prefill_s"))
        rows.append([c["depth"], hand * 1e3, f * 1e3, pre * 1e3, f / hand, pre / hand,
                     "yes" if c["same_logits"] else "NO"])
    print("Time to the first decoded token on rank 1 (ratio > 1: the handoff is faster)")
    print()
    print_table(["depth", "handoff ms", "load_session ms", "re-prefill ms",
                 "load_session / handoff", "re-prefill / handoff", "same logits bits"], rows)
    rows = []
    for c in cells:
        parts = [median(c[k]) * 1e3 for k in ("fingerprint_s", "capture_s", "sha256_s",
                                               "allocate_s", "install_s")]
        fingerprint, capture, sha, allocate, install = parts
        serial = capture + sha + median(c["raw_s"]) * 1e3 + fingerprint + sha + allocate + install
        rows.append([c["depth"], *parts, median(c["raw_s"]) * 1e3, serial,
                     median(c["handoff_s"]) * 1e3])
    print("Where a handoff's time goes: its parts timed one at a time on rank 1 (capture "
          "includes the sender's fingerprint; each side hashes every tensor once; serial = "
          "capture + sha256 + raw + fingerprint + sha256 + allocate + install)")
    print()
    print_table(["depth", "fingerprint ms", "capture ms", "sha256 ms", "allocate ms",
                 "install ms", "raw ms", "serial sum ms", "handoff ms"], rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "MLX_RANK" not in os.environ:
        return launch(argv)
    group = mx.distributed.init(backend="ring", strict=True)
    if group.size() != 2:
        raise SystemExit(f"handoff.py needs 2 ranks, got {group.size()}")
    model = build_model(args)
    if group.rank() == 0:
        sender(group, model, args)
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        cells = receiver(group, model, args, workdir)
        local(model, cells, args)
    report(cells, args)
    write_json(args.json, {"cells": cells})
    return 0 if all(c["same_logits"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
