"""How fast do sessions save and load against the raw disk, and what does a speculative rollback cost?

Three measurements on a Muse-shaped cache (``_harness.geometry``: layer i global
iff i % 4 == 3, 2 KV heads x 128, window 2048), each beside its naive
alternative in the same run, with the ratio (absolute numbers are context: a
disk, a page cache and a CPU are shared):

1. **Sessions at disk speed**, GB/s against raw I/O of the same
   bytes. A cache at full depth (default 131,072 x 52 layers: 1,826,619,392 B of
   planes, every row live) is saved with ``save_session`` and loaded with
   ``load_session`` (a cache for a tiny Muse Glimmer of ``max_position_embeddings
   = depth``); raw I/O writes the planes' bytes as they lie to a new file and
   reads the file into one new buffer, on the same filesystem, the two
   alternating ``--repeats`` times. Loads are timed cold (the file's pages
   evicted: ``posix_fadvise(DONTNEED)`` on that file only, after its fsync) and
   warm (the page cache); target muser-kv / raw >= 0.8; every load is checked bit
   for bit. A second table (``--no-parts`` skips it) times muser-kv's parts
   alone, and the floor under any load: the payload's bytes of fresh MLX and
   numpy memory, and the warm raw read into one MLX buffer. ``--no-prefetch``
   loads without CUDA's bulk prefetch of managed memory (``muser_kv.sessions.managed``).
2. **Speculative rollback, ms.** A second cache (``max_context = depth +
   max(blocks)``) filled to ``depth`` (rings wrapped, retained rows at their
   steady state). Per block of B tokens: ``cp = muser_kv.checkpoint(cache, B)``,
   B tokens written (``--write chunk``: one ``update_and_fetch`` of B rows per
   layer, as a verify pass writes them; ``steps``: B one-token steps), then
   ``cp.rollback()`` (+ ``mx.eval`` of every plane) timed against the naive
   alternative, an ``mx.array`` copy of every plane. The first round per B is
   untimed and checks that the rollback is exact.
3. **What a checkpoint holds**: ``cp.nbytes`` open and with the block written,
   ``sum(c.retained_nbytes)``, the planes' bytes, the ``mx.get_active_memory()``
   deltas while it is open, beside what the naive copy holds.

Files go to a fresh temporary directory (under ``--dir``, else the system's),
removed afterwards; the run refuses to start unless ~2.5x the session's bytes
are free there.

    bash benchmarks/device.sh sessions          # H200, full: 131,072 x 52 layers (disk: section 1)
    PYTHONPATH=. .venv/bin/python benchmarks/sessions.py --depth 32768 --skip 2,3   # CPU, ~3 min
    PYTHONPATH=. .venv/bin/python benchmarks/sessions.py --depth 8192 --layers 8    # CPU
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Dict, List, Sequence, Tuple

import _harness as H
import mlx.core as mx
import numpy as np

import muser_kv
from muser_kv.sessions import managed
from muser_kv.sessions.tensorfile import CHUNK  # the bytes per call, both sides

KIB = 1 << 10
DISK_FACTOR = 2.5  # free space required, in multiples of the session's bytes
TARGET = 0.8  # the goal: save and load at no less than 0.8x raw I/O of the same bytes


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--depth", type=H.one_int, default=131072, metavar="N",
                   help="session depth in positions, = max_context of the saved cache "
                        "(default 131072; 'k' suffix allowed)")
    p.add_argument("--blocks", type=H.int_list, default=[1, 4, 16],
                   help=f"speculative block lengths B (default 1,4,16; at most "
                        f"{muser_kv.MAX_BLOCK})")
    p.add_argument("--write", choices=("chunk", "steps"), default="chunk",
                   help="how a block is written: one update_and_fetch of B rows per layer "
                        "(chunk, default) or B one-token steps")
    p.add_argument("--rollback-repeats", type=int, default=10,
                   help="timed rollbacks (and plane copies) per block length (default 10)")
    p.add_argument("--dir", default=None,
                   help="where the session files go (a fresh subdirectory, removed afterwards; "
                        "default: the system's temporary directory)")
    p.add_argument("--no-parts", dest="parts", action="store_false",
                   help="skip the table of muser-kv's parts (each timed alone) in section 1")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="loads without the CUDA managed-memory prefetch (managed.ENABLED = False), "
                        "to measure what it buys; nothing to turn off on the CPU or Metal")
    p.add_argument("--skip", type=H.int_list, default=[], metavar="SECTIONS",
                   help="sections to skip, e.g. --skip 1 (1: sessions, 2+3: rollback)")
    H.add_flags(p, ("layers", "window", "kv_heads", "head_dim"),
                blocks=("repeats", 3, "saves and loads per system, alternating; the median"))
    args = H.parse(p, argv)
    if args.layers < 1 or args.depth < 1 or args.repeats < 1 or args.rollback_repeats < 1:
        p.error("--depth, --layers, --repeats and --rollback-repeats must be positive")
    for b in args.blocks:
        if not 1 <= b <= muser_kv.MAX_BLOCK:
            p.error(f"--blocks: each B must be in [1, {muser_kv.MAX_BLOCK}], got {b}")
    if args.depth < muser_kv.DEFAULT_RETAIN:
        p.error(f"--depth must be at least {muser_kv.DEFAULT_RETAIN}")
    return args


# -- filling a cache cheaply -------------------------------------------------------


def planes(cache: Sequence[Any]) -> List[mx.array]:
    return [p for c in cache for p in (c.keys, c.values)]


def fill_installed(cache: Sequence[Any], position: int) -> None:
    """Every layer at ``position`` with random f16 rows, via ``plane.install``
    (the rows a sequential fill would leave, at the rotation it would leave them)."""
    for c in cache:
        rows = min(position, c.capacity) if c.kind is muser_kv.LayerKind.SLIDING else position
        k, v = (mx.random.normal((rows, c.kv_heads, c.head_dim)).astype(mx.float16)
                for _ in "kv")
        c.install(position - rows, k, v)
        mx.eval(c.keys, c.values)
        del k, v
    assert all(c.offset == position for c in cache), [c.offset for c in cache]


def same_planes(a: Sequence[mx.array], b: Sequence[mx.array]) -> bool:
    return all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b))


# -- the disk -----------------------------------------------------------------------


def filesystem(path: str) -> str:
    """``"ext4 on /dev/vda (/)"``: the mount holding ``path`` (tmpfs would be memory)."""
    path = os.path.realpath(path)
    best = ("?", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        return "unknown filesystem"
    return f"{best[2]} on {best[0]} ({best[1]})"


def check_disk(directory: str, payload: int) -> None:
    free = shutil.disk_usage(directory).free
    need = int(DISK_FACTOR * payload)
    if free < need:
        raise SystemExit(
            f"sessions.py: refusing to run: {directory} has {free / H.GB:,.2f} GB free, the "
            f"benchmark needs ~{DISK_FACTOR}x the session's {payload:,} B = {need / H.GB:,.2f} GB. "
            f"Pass --dir on a larger filesystem, or a smaller --depth / --layers."
        )


# -- section 1: sessions ------------------------------------------------------------


def save_ours(path: str, cache) -> float:
    mx.eval(planes(cache))
    t0 = H.now()
    muser_kv.save_session(path, cache)
    return H.now() - t0


def load_ours(path: str, model) -> Tuple[float, List[Any]]:
    t0 = H.now()
    # the model only sizes the cache (its rows were never computed by any
    # model), so the session records no fingerprint: say so
    loaded = muser_kv.load_session(path, model, allow_other_model=True)
    mx.eval(planes(loaded))
    return H.now() - t0, loaded


def save_raw(path: str, cache) -> float:
    """The same bytes as they lie in the planes (at full depth every plane row is
    live, so the planes are the payload), ``CHUNK`` per ``os.write``, into a new
    file; then fsync."""
    src = planes(cache)
    mx.eval(src)
    t0 = H.now()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        for p in src:
            buf = memoryview(np.ascontiguousarray(np.asarray(p))).cast("B")
            while buf:
                buf = buf[os.write(fd, buf[:CHUNK]):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return H.now() - t0


def load_raw(path: str, into_mlx: bool = False) -> Tuple[float, np.ndarray]:
    """The file's bytes into one new buffer of its size, ``CHUNK`` per ``readinto``:
    numpy's (``np.empty``), or with ``into_mlx`` an ``mx.zeros`` (a load must end
    in MLX memory; on the CPU that is 4 KiB pages where numpy's are huge)."""
    t0 = H.now()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if into_mlx:
            out = np.asarray(mx.zeros((size,), mx.uint8))
            assert out.flags.writeable
        else:
            out = np.empty(size, np.uint8)
        view, done = memoryview(out), 0
        while done < out.nbytes:
            got = f.readinto(view[done:done + CHUNK])
            if not got:
                raise OSError(f"{path}: short read at {done}")
            done += got
    return H.now() - t0, out


def raw_equals(buf: np.ndarray, src: Sequence[mx.array]) -> bool:
    offset = 0
    for p in src:
        a = np.asarray(p).reshape(-1).view(np.uint8)
        if not np.array_equal(buf[offset:offset + a.nbytes], a):
            return False
        offset += a.nbytes
    return offset == buf.nbytes


def ours_parts(path: str, cache) -> Dict[str, float]:
    """Ours, split into separately timed calls: capture (the logical cut,
    evaluated), XXH3-128 of every tensor on the save's digest threads, sha256
    (version 2's digest, for comparison), read_session (read and verify; the file
    evicted first), restore_into a ``make_cache_for`` cache (allocate, install)."""
    from muser_kv.sessions.format import tensor_digests

    parts: Dict[str, float] = {}
    with H.clock(parts, "capture"):
        snap = muser_kv.SessionSnapshot.capture(cache)
    arrays = {f"{i}{kv}": np.asarray(a) for i, c in enumerate(snap.layers)
              for kv, a in (("k", c.keys), ("v", c.values))}
    for name in ("xxh3-128", "sha256"):
        with H.clock(parts, name):
            tensor_digests(arrays, name)
    del arrays, snap
    if H.can_evict():
        H.evict(path)
    with H.clock(parts, "read_session"):
        snap = muser_kv.read_session(path)
    with H.clock(parts, "restore_into"):
        target = muser_kv.make_cache_for(snap.geometry)
        muser_kv.restore_into(target, snap)
        mx.eval(planes(target))
    del target, snap
    H.settle()
    # the floor under any load: fresh memory for the planes, as MLX allocates it
    # (a load must produce MLX arrays) and as numpy does (the raw read's buffer)
    n = sum(p.nbytes for p in planes(cache))
    with H.clock(parts, "fresh MLX memory"):
        fresh = mx.zeros((n,), mx.uint8)
        mx.eval(fresh)
    del fresh
    H.settle()
    with H.clock(parts, "fresh numpy memory"):
        buf = np.empty(n, np.uint8)
        buf.fill(0)
    del buf
    H.settle()
    parts["raw read into MLX memory"] = load_raw(path, into_mlx=True)[0]  # warm: read above
    H.settle()
    return parts



def bench_sessions(args, workdir: str) -> Dict[str, Any]:
    depth = args.depth
    geo = H.geometry(args, depth)
    cache = muser_kv.make_cache_for(geo)
    fill_installed(cache, depth)
    payload = sum(p.nbytes for p in planes(cache))
    assert payload == muser_kv.footprint(geo, depth).slot_bytes, payload
    # a tiny model of this KV geometry: what load_session sizes the cache with
    model = H.build_model(args, hidden_size=64, intermediate_size=64, vocab_size=64,
                          num_attention_heads=args.kv_heads, max_position_embeddings=depth)
    src, metas = planes(cache), [c.meta_state for c in cache]
    live = sum(c.ring.len for c in cache) * geo.kv_dim * 2 * src[0].dtype.size
    assert live == payload, (live, payload)  # every plane row is live: raw = the same bytes
    paths = {"ours": os.path.join(workdir, "session.safetensors"),
             "raw": os.path.join(workdir, "session.raw")}
    cold = H.can_evict()
    modes = ("load_cold", "load_warm") if cold else ("load_warm",)
    t = {s: {"save": [], "load_cold": [], "load_warm": []} for s in paths}
    parts: Dict[str, List[float]] = {}
    sizes: Dict[str, int] = {}
    exact = {"ours": True, "raw": True}

    def run(s: str, _block: int) -> None:
        """One save and its loads (cold, warm) of muser-kv (``ours``) or raw I/O."""
        path = paths[s]
        t[s]["save"].append(save_ours(path, cache) if s == "ours" else save_raw(path, cache))
        sizes[s] = os.path.getsize(path)
        for mode in modes:
            if mode == "load_cold":
                H.evict(path)
            if s == "ours":
                dt, loaded = load_ours(path, model)
                ok = same_planes(planes(loaded), src) and [c.meta_state for c in loaded] == metas
            else:
                dt, loaded = load_raw(path)
                ok = raw_equals(loaded, src)
            t[s][mode].append(dt)
            exact[s] &= ok
            del loaded
            H.settle()
        if s == "ours" and args.parts:
            for k, v in ours_parts(path, cache).items():
                parts.setdefault(k, []).append(v)
        os.unlink(path)
        H.settle()

    H.settle()
    H.alternate(args.repeats, run, tuple(paths))
    rows, results = [], []
    labels = {"save": "save (fsync'd)", "load_cold": "load, cold (file evicted)",
              "load_warm": "load, warm (page cache)"}
    for op in ("save",) + modes:
        ours_s, raw_s = H.median(t["ours"][op]), H.median(t["raw"][op])
        ours_gbs, raw_gbs = payload / ours_s / H.GB, payload / raw_s / H.GB
        ratio = ours_gbs / raw_gbs
        rows.append([labels[op], ours_s, ours_gbs, raw_s, raw_gbs, ratio,
                     "yes" if ratio >= TARGET else "NO"])
        results.append({"op": op, "ours_s": t["ours"][op], "raw_s": t["raw"][op],
                        "ours_GBps": ours_gbs, "raw_GBps": raw_gbs,
                        "ratio_ours_over_raw": ratio, "meets_target": ratio >= TARGET})
    return {"payload_bytes": payload, "file_bytes": sizes, "rows": rows, "results": results,
            "parts_s": parts, "exact": exact, "evicted_loads": cold, "target": TARGET}


# -- sections 2 and 3: speculative rollback -----------------------------------------------


def write_block(cache, block: mx.array, mode: str) -> None:
    if mode == "chunk":
        outs = [c.update_and_fetch(block, block) for c in cache]
        mx.eval(outs, planes(cache))
        del outs
        return
    for j in range(block.shape[2]):
        x = block[:, :, j:j + 1]
        outs = [c.update_and_fetch(x, x) for c in cache]
        mx.eval(outs, planes(cache))
        del outs


def copy_planes(cache) -> Tuple[float, List[mx.array]]:
    """The naive checkpoint: a copy of every plane, evaluated."""
    src = planes(cache)
    t0 = H.now()
    copies = [mx.array(p) for p in src]
    mx.eval(copies)
    return H.now() - t0, copies


def state_equals(cache, ref: Sequence[mx.array], metas) -> bool:
    """Rings equal; sliding planes equal; global planes equal on their live rows
    (a rolled-back global plane rewinds metadata only: rows past its end are dead)."""
    if [c.meta_state for c in cache] != metas:
        return False
    for i, c in enumerate(cache):
        k, v = ref[2 * i], ref[2 * i + 1]
        if c.kind is muser_kv.LayerKind.GLOBAL:
            n = c.ring.len
            pairs = ((c.keys[:, :n], k[:, :n]), (c.values[:, :n], v[:, :n]))
        else:
            pairs = ((c.keys, k), (c.values, v))
        if not all(mx.array_equal(a, b).item() for a, b in pairs):
            return False
    return True


def bench_rollback(args) -> Dict[str, Any]:
    depth, dtype = args.depth, H.DTYPES[args.dtype]
    geo = H.geometry(args, depth + max(args.blocks))
    cache = muser_kv.make_cache_for(geo)
    steady = muser_kv.DEFAULT_RETAIN  # one-token steps that end the fill: retained rows full
    fill_installed(cache, depth - steady)
    write_block(cache, mx.random.normal((1, args.kv_heads, steady, args.head_dim)).astype(dtype),
                "steps")
    plane_bytes = sum(p.nbytes for p in planes(cache))
    wrapped = all(c.ring.wrapped for c in cache if c.kind is muser_kv.LayerKind.SLIDING)
    rows, mem_rows, results = [], [], []
    for B in args.blocks:
        block = mx.random.normal((1, args.kv_heads, B, args.head_dim)).astype(dtype)
        mx.eval(block)
        cell: Dict[str, List[float]] = {}
        for r in range(args.rollback_repeats + 1):  # round 0: untimed, checks exactness
            m: Dict[str, float] = {}
            H.settle()  # the naive alternative first, timed in the same loop
            m0 = mx.get_active_memory()
            dt, copies = copy_planes(cache)
            m["copy_ms"], m["copy_active"] = dt * 1e3, mx.get_active_memory() - m0
            metas = [c.meta_state for c in cache]
            if r:
                del copies
            H.settle()
            m0 = mx.get_active_memory()
            with H.clock(m, "open_ms"):
                cp = muser_kv.checkpoint(cache, B)
            H.settle()
            m["active_open"], m["cp_nbytes_open"] = mx.get_active_memory() - m0, cp.nbytes
            with H.PeakProbe() as wprobe, H.clock(m, "write_ms"):
                write_block(cache, block, args.write)
            assert all(c.offset == depth + B for c in cache)
            H.settle()
            m["active_block"], m["cp_nbytes_block"] = mx.get_active_memory() - m0, cp.nbytes
            m["retained_nbytes_block"] = sum(c.retained_nbytes for c in cache)
            with H.PeakProbe() as rprobe, H.clock(m, "rollback_ms"):
                undone = cp.rollback()
                mx.eval(planes(cache))
            assert undone == B and all(c.offset == depth for c in cache)
            del cp
            H.settle()
            m["active_after"] = mx.get_active_memory() - m0
            m["rollback_peak_extra"], m["write_peak_extra"] = rprobe.extra, wprobe.extra
            for k in ("open_ms", "write_ms", "rollback_ms"):
                m[k] *= 1e3
            if r == 0:
                exact = state_equals(cache, copies, metas)
                del copies
            else:
                for k, v in m.items():
                    cell.setdefault(k, []).append(v)
        rb, cp_ms = H.median(cell["rollback_ms"]), H.median(cell["copy_ms"])
        rows.append([B, H.median(cell["open_ms"]), H.median(cell["write_ms"]), rb, cp_ms,
                     cp_ms / rb if rb > 0 else float("nan"),
                     max(cell["rollback_peak_extra"]) / H.MB, "yes" if exact else "NO"])
        held = max(cell["cp_nbytes_block"])
        mem_rows.append([B, max(cell["cp_nbytes_open"]) / KIB, held / KIB,
                         max(cell["retained_nbytes_block"]) / KIB, plane_bytes / H.MB,
                         plane_bytes / held if held else float("nan"),
                         H.median(cell["active_open"]) / KIB, H.median(cell["active_block"]) / KIB,
                         H.median(cell["copy_active"]) / H.MB])
        results.append({"block": B, "exact": exact, **cell,
                        "ratio_copy_over_rollback": cp_ms / rb if rb > 0 else None})
    del cache
    H.settle()
    return {"plane_bytes": plane_bytes, "max_context": geo.max_context, "wrapped": wrapped,
            "rows": rows, "mem_rows": mem_rows, "results": results}


# -- main -------------------------------------------------------------------------------


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    mx.random.seed(args.seed)
    managed.ENABLED = args.prefetch
    geo = H.geometry(args, args.depth)
    fp = muser_kv.footprint(geo, args.depth)
    base = args.dir or tempfile.gettempdir()
    if not os.path.isdir(base):
        raise SystemExit(f"sessions.py: --dir {base} is not a directory")
    do_sessions, do_rollback = 1 not in args.skip, not {2, 3} & set(args.skip)
    if do_sessions:
        check_disk(base, fp.slot_bytes)
    H.print_header(
        "sessions: save/load GB/s vs raw I/O, speculative rollback vs copying the planes",
        args,
        f"geometry: {args.layers} layers ({geo.sliding_layers} sliding, {geo.global_layers} "
        f"global), {args.kv_heads} KV heads x {args.head_dim}, window {args.window}; "
        f"planes at depth {args.depth:,}: {fp.slot_bytes:,} B ({fp.slot_bytes / H.GB:,.3f} GB)\n"
        f"files in {base}: {filesystem(base)}",
    )
    payload: Dict[str, Any] = {"benchmark": "sessions", "args": vars(args),
                               "footprint_slot_bytes": fp.slot_bytes}

    if do_sessions:
        workdir = tempfile.mkdtemp(prefix="muser-kv-sessions-", dir=base)
        try:
            s = bench_sessions(args, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        H.settle()
        payload["sessions"] = {k: v for k, v in s.items() if k != "rows"}
        H.table(["operation", "muser-kv s", "muser-kv GB/s", "raw s", "raw GB/s", "muser-kv / raw",
                 f">= {s['target']}"], s["rows"], digits=3,
                title=f"1. Sessions at disk speed, depth {args.depth:,}: save_session / load_session "
                f"against raw I/O of the same {s['payload_bytes']:,} B (the planes) on the same "
                f"filesystem, this run (file: muser-kv {s['file_bytes'].get('ours', 0):,} B with "
                f"its header, raw {s['file_bytes'].get('raw', 0):,} B); median of "
                f"{args.repeats}; GB = 1e9 B; target muser-kv / raw >= {s['target']}")
        print("muser-kv: save_session (logical cut, from the planes where the host reads them "
              "in place, XXH3-128 of every tensor, safetensors, fsync, "
              "rename, directory fsync) / load_session (read, verify every digest, a new cache "
              "for a tiny Model, install at the live rotation, evaluated). raw: write = the "
              f"planes' bytes as they lie, {CHUNK >> 20} MiB per os.write, fsync; read = the "
              f"file into one new buffer of its size, {CHUNK >> 20} MiB per readinto. "
              + ("cold: posix_fadvise(DONTNEED) on that file (fsync'd) just before the read; "
                 "warm: read again straight after."
                 if s["evicted_loads"] else "posix_fadvise unavailable: warm loads only."))
        print(f"bit-exact: muser-kv's loads against the source planes and rings "
              f"{'yes' if s['exact']['ours'] else 'NO'}, raw reads against the planes' bytes "
              f"{'yes' if s['exact']['raw'] else 'NO'}")
        print()
        parts = s["parts_s"]
        if parts:
            save_s = H.median(s["results"][0]["ours_s"])
            load_key = "load_cold" if s["evicted_loads"] else "load_warm"
            load_s = H.median(next(r["ours_s"] for r in s["results"] if r["op"] == load_key))
            part_rows = []
            for name, ref in (("capture", save_s), ("xxh3-128", save_s), ("sha256", save_s),
                              ("read_session", load_s), ("restore_into", load_s),
                              ("fresh MLX memory", load_s), ("fresh numpy memory", load_s),
                              ("raw read into MLX memory", load_s)):
                v = H.median(parts[name])
                part_rows.append([name, v, s["payload_bytes"] / v / H.GB, 100 * v / ref])
            H.table(["part", "s", "GB/s", "% of save/load"], part_rows, digits=3,
                    title="   muser-kv's parts, each timed alone (median; share of the save / the "
                    f"{'cold ' if s['evicted_loads'] else ''}load above: the save and load "
                    "overlap them, so shares add up to more)")
            print("capture = SessionSnapshot.capture (the cut in logical order, evaluated: "
                  "what a save gathers on CUDA; on the CPU and Metal it writes from the planes); "
                  "xxh3-128 / sha256 = tensor_digests of every tensor (version 3's digest; "
                  "version 2's, for comparison), on the save's digest threads; read_session = "
                  "read + verify" + (" (file evicted first)" if s["evicted_loads"] else "")
                  + "; restore_into = make_cache_for + install, evaluated; fresh MLX / numpy "
                  "memory = the payload's bytes newly allocated and written once, by mx.zeros "
                  "(what a load's planes cost before a byte is read) / np.empty + fill (the "
                  "raw read's buffer; numpy asks for transparent huge pages); raw read into "
                  "MLX memory = the raw read, warm, into one mx.zeros buffer instead")
            print()

    if do_rollback:
        r = bench_rollback(args)
        payload["rollback"] = {k: v for k, v in r.items() if k not in ("rows", "mem_rows")}
        H.table(["B", "checkpoint ms", "write B ms", "rollback ms", "copy planes ms",
                 "copy / rollback", "rollback peak+ MiB", "exact"], r["rows"], digits=3,
                title=f"2. Speculative rollback at depth {args.depth:,} ({args.layers} layers, rings "
                f"{'wrapped' if r['wrapped'] else 'NOT wrapped (depth <= window)'}; cache "
                f"max_context {r['max_context']:,}, planes {r['plane_bytes']:,} B); write = "
                f"{args.write}; median of {args.rollback_repeats}",
                note="rollback = cp.rollback() + mx.eval(every plane); copy planes = mx.array(p) "
                "for every K/V plane, evaluated (the naive checkpoint); exact = after the rollback, "
                "rings, sliding planes and global live rows equal a copy taken before the block; "
                "peak+ = peak memory during the rollback - memory active before it")
        H.table(["B", "cp.nbytes open KiB", "cp.nbytes block KiB", "sum retained KiB", "planes MiB",
                 "planes / cp.nbytes", "active open KiB", "active block KiB", "copy active MiB"],
                r["mem_rows"], digits=1,
                title="3. What a checkpoint holds (cp.nbytes = sum of c.retained_nbytes: the rows "
                "the rings keep anyway; active deltas are mx.get_active_memory() against before "
                "checkpoint(), median)",
                note="open: right after checkpoint(); block: with the B tokens written, checkpoint "
                "still open; copy active: what the naive copy of every plane holds")
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
