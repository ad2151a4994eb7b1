"""The ``muser-kv`` command."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .geometry import MuseGeometry, footprint


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / 1e9:.3f} GB, {n / 2**30:.3f} GiB)"


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
        f"{g.kv_heads} KV heads x {g.head_dim}, f16"
    )
    print(f"row: {g.row_bytes:,} B per layer per token (K+V)")
    print(f"context {fp.context:,}, {fp.slots} slot(s)")
    print(f"  SWA rings   (one slot): {_bytes(fp.swa_bytes)}")
    print(f"  NoPE planes (one slot): {_bytes(fp.nope_bytes)}")
    print(f"  one slot:               {_bytes(fp.slot_bytes)}")
    print(f"  {fp.slots} slot(s):              {_bytes(fp.total_bytes)}")
    print(f"  per token below window: {fp.per_token_below_window:,} B")
    print(f"  per token above window: {fp.per_token_above_window:,} B")
    ratio = fp.slot_bytes / at_window.slot_bytes
    naive = fp.context / g.window
    print(
        f"  kv({fp.context:,}) / kv({g.window:,}) = {ratio:.2f}x "
        f"(naive {fp.context:,}/{g.window:,} = {naive:.2f}x)"
    )
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
        raise SystemExit("--plot needs matplotlib: pip install 'muser-kv[plot]'") from e
    xs = sorted(set(range(1, context + 1, max(context // 512, 1))) | {min(g.window, context), context})
    swa = [footprint(g, c).swa_bytes / 1e9 for c in xs]
    nope = [footprint(g, c).nope_bytes / 1e9 for c in xs]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, nope, label=f"NoPE: {g.global_layers} x C x {g.row_bytes:,} B")
    ax.plot(xs, swa, label=f"SWA: {g.sliding_layers} x min(C, {g.window:,}) x {g.row_bytes:,} B")
    ax.axvline(g.window, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("context C (tokens)")
    ax.set_ylabel("KV bytes per slot (GB)")
    ax.set_title("The two growth regimes (seeds Figure 22.1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muser-kv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = MuseGeometry()
    fp = sub.add_parser("footprint", help="KV bytes for a context and slot count")
    fp.add_argument("--context", type=int, default=d.max_context)
    fp.add_argument("--slots", type=int, default=1)
    fp.add_argument("--layers", type=int, default=d.num_layers)
    fp.add_argument("--window", type=int, default=d.window)
    fp.add_argument("--kv-heads", type=int, default=d.kv_heads)
    fp.add_argument("--head-dim", type=int, default=d.head_dim)
    fp.add_argument("--plot", metavar="FILE.png", help="draw the two curves (needs matplotlib)")
    fp.set_defaults(func=cmd_footprint)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    if getattr(ns, "context", 1) <= 0 or getattr(ns, "slots", 1) <= 0:
        print("muser-kv: --context and --slots must be positive", file=sys.stderr)
        return 2
    return ns.func(ns)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
