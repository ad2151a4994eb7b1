"""The ``muser-kv`` command (``DESCRIPTION``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, List, Optional

from muser_kv.core.geometry import ROW_GRANULE, LayerKind, MuseGeometry, allocated_rows, footprint
from muser_kv.serving.arg_types import positive

if TYPE_CHECKING:  # for the annotation only; cmd_inspect imports it when it runs
    from muser_kv.sessions.reading import SessionFile

#: what ``muser-kv --help`` says the command is (every module it names exists)
DESCRIPTION = ("footprint, inspect, selftest, store, and mlx-lm's generate, chat, cache-prompt "
               "(muser_kv.serving.commands) and server (muser_kv.serving.server.serve) on muser-kv's "
               "caches")


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / 1e9:.3f} GB, {n / 2**30:.3f} GiB)"


def _heads(g: MuseGeometry) -> str:
    """K/V heads x head_dim, per kind where they differ."""
    if g.uniform:
        return f"{g.kv_heads} KV heads x {g.head_dim}"
    (sh, sd), (gh, gd) = g.dims(LayerKind.SLIDING), g.dims(LayerKind.GLOBAL)
    return f"{sh} KV heads x {sd} (sliding), {gh} x {gd} (global)"


def _geometry(ns: argparse.Namespace) -> MuseGeometry:
    return MuseGeometry(
        num_layers=ns.layers,
        window=ns.window,
        max_context=max(ns.context, 1),
        kv_heads=ns.kv_heads,
        head_dim=ns.head_dim,
        num_heads=ns.kv_heads,  # query heads do not enter the footprint
    )


def cmd_footprint(ns: argparse.Namespace) -> int:
    g = _geometry(ns)
    fp = footprint(g, ns.context, ns.slots)
    at_window = footprint(g, g.window, 1)
    print(
        f"geometry: {g.num_layers} layers ({g.sliding_layers} sliding RoPE, "
        f"{g.global_layers} global NoPE), window {g.window}, "
        f"{g.kv_heads} KV heads x {g.head_dim}, {ns.plane_dtype} planes"
    )
    print(f"row: {g.row_bytes:,} B per layer per token (K+V)")
    ring = min(fp.context, g.window)
    print(f"context {fp.context:,}, {fp.slots} slot(s); rows allocated in multiples of "
          f"{ROW_GRANULE}: rings {allocated_rows(ring):,} for {ring:,}, "
          f"global planes {allocated_rows(fp.context):,} for {fp.context:,}")
    print(f"  SWA rings   (one slot): {_bytes(fp.swa_bytes)}")
    print(f"  NoPE planes (one slot): {_bytes(fp.nope_bytes)}")
    print(f"  one slot:               {_bytes(fp.slot_bytes)}")
    print(f"  {fp.slots} slot(s):              {_bytes(fp.total_bytes)}")
    if fp.formula_bytes != fp.slot_bytes:
        print(f"  one slot by the formula (rows not rounded): {_bytes(fp.formula_bytes)}")
    print(f"  per token below window: {fp.per_token_below_window:,} B")
    print(f"  per token above window: {fp.per_token_above_window:,} B")
    ratio = fp.slot_bytes / at_window.slot_bytes
    naive = fp.context / g.window
    print(
        f"  kv({fp.context:,}) / kv({g.window:,}) = {ratio:.2f}x "
        f"(naive {fp.context:,}/{g.window:,} = {naive:.2f}x)"
    )
    print("  (preallocated planes: SlotPool, make_prompt_cache(..., preallocate=True); by "
          "default a global plane grows with its sequence, to at most twice its live rows "
          "rounded up to 256, never past these figures)")
    if ns.plot:
        _plot(g, ns.context, ns.plot)
        print(f"plot written to {ns.plot}")
    return 0


def _plot(g: MuseGeometry, context: int, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the extra
        raise SystemExit("--plot needs matplotlib: from the muser-kv checkout, "
                         "pip install -e '.[plot]' (or pip install matplotlib)") from e
    xs = sorted(set(range(1, context + 1, max(context // 512, 1))) | {min(g.window, context), context})
    swa = [footprint(g, c).swa_bytes / 1e9 for c in xs]
    nope = [footprint(g, c).nope_bytes / 1e9 for c in xs]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, nope, label=f"NoPE: {g.global_layers} x C x {g.row_bytes:,} B")
    ax.plot(xs, swa, label=f"SWA: {g.sliding_layers} x min(C, {g.window:,}) x {g.row_bytes:,} B")
    ax.axvline(g.window, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("context C (tokens)")
    ax.set_ylabel("KV bytes per slot (GB)")
    ax.set_title("KV bytes per slot: the two growth regimes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_ENCODING_NAMES = {"f16le": "float16 planes", "bf16le": "bfloat16 planes",
                   "f32le": "float32 interchange"}


def cmd_inspect(ns: argparse.Namespace) -> int:
    """Print a session file's header and layers and verify every checksum.
    Exit 0 when everything verifies, 1 on any mismatch, 2 when unreadable (one
    line on stderr says why; inspect never removes or changes a file)."""
    from muser_kv.sessions.format import SnapshotError
    from muser_kv.sessions.reading import open_session

    try:
        session = open_session(ns.file, tidy=False)
    except (OSError, SnapshotError) as e:
        print(f"muser-kv inspect: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a reader bug: still one line, and still a refusal
        print(f"muser-kv inspect: {ns.file}: unreadable ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    return _report(session)


def _report(session: SessionFile) -> int:
    from muser_kv.sessions.format import SnapshotError, tensor_names
    h, g = session.header, session.header.geometry
    print(f"file: {session.path}")
    print(f"format: {h.format}  version: {h.version}  tensor checksums: {h.digest}")
    print(
        f"geometry: {g.num_layers} layers ({g.sliding_layers} sliding RoPE, {g.global_layers} "
        f"global NoPE), window {g.window}, max_context {g.max_context}, "
        f"{_heads(g)}"
    )
    print(f"position: {h.position}  encoding: {h.encoding} ({_ENCODING_NAMES[h.encoding]})")
    print(f"user: {json.dumps(h.user, sort_keys=True)}")
    if h.model is None:
        print("model: not recorded (a load needs allow_other_model=True)")
    else:
        print(f"model: config sha256 {h.model['config']}, weights sha256 {h.model['weights']} "
              f"({h.model['scheme']})")
    checks = {c.name: c for c in session.verify()}
    bad = sum(not c.ok for c in checks.values())
    print(f"{'layer':>5}  {'kind':17}  {'start':>7}  {'rows':>7}  {'tensor':18}  "
          f"{'shape':15}  {'dtype':7}  checksum")
    for i in range(g.num_layers):
        for name in tensor_names(i):
            t = session.tensors.get(name)
            rows = str(t.shape[0]) if t is not None and t.shape else "-"
            shape = "-" if t is None else str(list(t.shape))
            dtype = "-" if t is None else t.dtype_name
            check = checks.pop(name)
            print(f"{i:>5}  {g.layer_kind(i).value:17}  {h.starts[i]:>7}  {rows:>7}  {name:18}  "
                  f"{shape:15}  {dtype:7}  {check.status}"
                  + (f" ({check.detail})" if check.detail else ""))
    for check in checks.values():  # tensors the geometry does not name
        print(f"{'-':>5}  {'-':17}  {'-':>7}  {'-':>7}  {check.name:18}  {'-':15}  {'-':7}  "
              f"{check.status} ({check.detail})")
    if not bad:
        try:
            session.snapshot()
            print("gate: OK")
        except SnapshotError as e:
            bad += 1
            print(f"gate: FAILED: {e}")
    print("result: OK" if not bad else f"result: {bad} problem(s)")
    return 1 if bad else 0


def cmd_selftest(ns: argparse.Namespace) -> int:
    """Every kernel on this machine's GPU against the reference path, bit for bit."""
    from muser_kv.core.selftest import main as selftest

    return selftest(ns.backend, jobs=ns.jobs)


def _store_bytes(n: Optional[int]) -> str:
    return "unbounded" if n is None else f"{n:,} bytes"


def cmd_store(ns: argparse.Namespace) -> int:
    """``stats``: a tier's chunks, bytes, bound and hit rate; ``gc``: evict to the bound.
    Both read or shrink a store that exists: anything else at the location
    (nothing, a file, a directory that is no store) is exit 2 with one line on
    stderr, and nothing is made there."""
    from muser_kv.sessions.store.store import open_tier

    try:
        tier = open_tier(ns.location, create=False)
    except (ValueError, OSError, ImportError) as e:
        print(f"muser-kv store {ns.action}: {e}", file=sys.stderr)
        return 2
    try:
        before = tier.stats()
        if ns.action == "stats":
            print(f"location: {ns.location} ({before.name})")
            print(f"chunks: {before.chunks:,}")
            print(f"bytes: {before.bytes:,}")
            print(f"capacity: {_store_bytes(before.capacity)}")
            rate = before.hit_rate
            print("hit rate: " + ("no lookups yet" if rate is None else
                                  f"{rate:.1%} ({before.hits:,} hits, {before.misses:,} misses)"))
            print(f"errors: {before.errors:,}")
            return 0
        bound = ns.max_bytes if ns.max_bytes is not None else before.capacity
        if bound is None:
            print(f"{ns.location}: no bound (pass --max-bytes N): nothing evicted")
            return 0
        evicted = tier.gc(bound)
        after = tier.stats()
        print(f"evicted {evicted:,} chunk(s), {max(before.bytes - after.bytes, 0):,} bytes; "
              f"now {after.chunks:,} chunk(s), {after.bytes:,} bytes (bound {_store_bytes(bound)})")
        return 0
    finally:
        tier.close()


def _byte_count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a byte count >= 0, got {text}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muser-kv", description=f"The muser-kv command: {DESCRIPTION}.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = MuseGeometry()
    fp = sub.add_parser("footprint", help="KV bytes for a context and slot count")
    fp.add_argument("--context", type=int, default=d.max_context)
    fp.add_argument("--slots", type=int, default=1)
    fp.add_argument("--layers", type=int, default=d.num_layers)
    fp.add_argument("--window", type=int, default=d.window)
    fp.add_argument("--kv-heads", type=int, default=d.kv_heads)
    fp.add_argument("--head-dim", type=int, default=d.head_dim)
    fp.add_argument("--plane-dtype", choices=("float16", "bfloat16"), default="float16",
                    help="the planes' type (both are 2 bytes: the bytes do not change)")
    fp.add_argument("--plot", metavar="FILE.png",
                    help="draw the two curves (needs matplotlib: the plot extra)")
    fp.set_defaults(func=cmd_footprint)
    ins = sub.add_parser("inspect", help="print a session file's header and verify its checksums")
    ins.add_argument("file", help="a session file written by muser_kv.save_session")
    ins.set_defaults(func=cmd_inspect)
    st = sub.add_parser("selftest", help="build every kernel on this GPU (Metal or CUDA) and "
                                         "check it bitwise against the reference path")
    st.add_argument("--backend", choices=("metal", "cuda"),
                    help="the kernel backend to test (default: the one this MLX has)")
    st.add_argument("--jobs", type=positive, default=None,
                    help="worker processes, each compiling its share of the kernel programs "
                         "(default: about the square root of their number, 4 for 16, at most "
                         "one per CPU; 1: all in this process)")
    st.set_defaults(func=cmd_selftest)
    store = sub.add_parser("store", help="a KV store's tier (a directory or redis://HOST:PORT[/db]): "
                                         "stats, or gc to its bound")
    store_sub = store.add_subparsers(dest="action", required=True)
    for action, text in (("stats", "print chunks, bytes, capacity and hit rate"),
                         ("gc", "evict least recently used chunks to the bound and print what went")):
        a = store_sub.add_parser(action, help=text)
        a.add_argument("location", help="a store directory or redis://HOST:PORT[/db]")
        if action == "gc":
            a.add_argument("--max-bytes", type=_byte_count, metavar="N",
                           help="the bound to evict to (default: the tier's own)")
        a.set_defaults(func=cmd_store)
    from muser_kv.serving.commands import COMMANDS
    for name, module in COMMANDS.items():  # listed here; main() hands their argv over whole
        sub.add_parser(name, add_help=False,
                       help=f"mlx-lm's {name} ({module}) on muser-kv caches, with mlx-lm's "
                            f"flags and --max-context/--retain/--plane-dtype/--session "
                            f"(muser-kv {name} --help)")
    # listed here for --help; main hands its arguments to mlx-lm's server parser (serve.main)
    sub.add_parser("serve", add_help=False,
                   help="mlx-lm's HTTP server (every mlx_lm.server flag) with muser-kv's caches "
                        "and an exact prompt cache; muser-kv serve --help lists the flags")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from muser_kv.serving.commands import COMMANDS
    if argv and argv[0] in COMMANDS:  # mlx-lm's parser (extended) reads the rest
        from muser_kv.serving.commands import main as run_command

        return run_command(argv[0], argv[1:])
    if argv[:1] == ["serve"]:
        from muser_kv.serving.server.serve import main as serve

        return serve(argv[1:])
    ns = build_parser().parse_args(argv)
    if getattr(ns, "context", 1) <= 0 or getattr(ns, "slots", 1) <= 0:
        print("muser-kv: --context and --slots must be positive", file=sys.stderr)
        return 2
    return ns.func(ns)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
