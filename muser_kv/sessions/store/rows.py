"""Rows between live lists and stored objects: ``gather`` takes a live list's
rows of some layers into layer-major blocks (one per ``kv_dim``, fresh buffers
of their own, through the cache's ``live_rows``), and ``cuts`` joins stored
blocks back into each layer's ``LayerCut`` for an install. Every copy is per
block and plane, never per layer and chunk, so a put's and a rebuild's
operations grow with the layers or the chunks, not their product."""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx

from muser_kv.caches.base import MuseKVCache
from muser_kv.core.geometry import LayerKind
from muser_kv.sessions.restore import LayerCut
from muser_kv.sessions.store import chunks
from muser_kv.sessions.store.chunks import Rows, Scope


def window_start(entries: List[MuseKVCache], n: int) -> int:
    """The first position every ring of a list at ``n`` tokens holds: the rings
    hold ``[window_start, n)`` (the latest origin, should theirs differ); ``n``
    for a list without one."""
    return max((e.ring.origin_logical for e in entries if e.kind is LayerKind.SLIDING),
               default=n)


def cuts(entries: List[MuseKVCache], scope: Scope, start: int, window: List[Rows],
         pieces: List[Rows]) -> List[LayerCut]:
    """Every layer's cut: the global layers' from ``pieces`` (rows from 0), the
    sliding layers' from ``window`` (rows from ``start``)."""
    out: List[Optional[LayerCut]] = [None] * len(entries)
    cut(out, entries, scope.global_layers, scope.shape(scope.global_layers), pieces, 0)
    cut(out, entries, scope.sliding_layers, scope.shape(scope.sliding_layers), window, start)
    return [c for c in out if c is not None]


def cut(cuts: List[Optional[LayerCut]], entries: List[MuseKVCache], layers: Tuple[int, ...],
         shape: Tuple[Tuple[Tuple[int, ...], int], ...], parts: List[Rows], first: int) -> None:
    """The cuts of ``layers`` from ``parts`` (consecutive rows, from ``first``):
    per block, one concatenate per plane along the rows, whatever the number of
    layers (on a GPU, a copy per part), then a view of it per layer."""
    for g, (at, _) in enumerate(shape):
        if parts:
            k = _join([p.blocks[g].keys for p in parts])
            v = _join([p.blocks[g].values for p in parts])
        else:
            e = entries[layers[at[0]]]
            k = v = mx.zeros((len(at), 0, e.kv_dim), e.dtype)
        for row, i in enumerate(at):
            e = entries[layers[i]]
            rows = (int(k.shape[1]), e.kv_heads, e.head_dim)
            # a slice, not k[row]: an integer index is a gather (a copy), a slice a view
            cuts[layers[i]] = LayerCut(first, k[row:row + 1].reshape(rows),
                                       v[row:row + 1].reshape(rows))


def _join(blocks: List[mx.array]) -> mx.array:
    return blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=1)


def gather(entries: List[MuseKVCache], layers: Tuple[int, ...],
            ranges: List[Tuple[int, int]]) -> List[Rows]:
    """Rows ``[lo, hi)`` of ``layers`` for each of ``ranges`` (disjoint), each
    in fresh buffers of its own (the memory tier counts and frees them one by
    one). Per block of layers, each layer's rows of a run of adjacent ranges are
    gathered at once (the cache's ``live_rows``, which un-rotates a ring) and
    stacked into one layer-major block, then cut into the ranges: the number of
    operations grows with the layers or with the ranges, not their product."""
    blocks: List[List[chunks.Block]] = [[] for _ in ranges]
    order = sorted((i for i, (lo, hi) in enumerate(ranges) if hi > lo), key=lambda i: ranges[i])
    for at in chunks.blocks_of([entries[i].kv_dim for i in layers]):
        for i, (lo, hi) in enumerate(ranges):
            if hi == lo:
                e = entries[layers[at[0]]]
                empty = mx.zeros((len(at), 0, e.kv_dim), e.dtype)
                blocks[i].append(chunks.Block(at, empty, empty))
        # a block of one layer is a gather of each range: a part of a shared one
        # would be a view of it, not a buffer of its own
        for run in (_adjacent(ranges, order) if len(at) > 1 else [[i] for i in order]):
            lo, hi = ranges[run[0]][0], ranges[run[-1]][1]
            rows = [entries[layers[i]].live_rows(lo, hi) for i in at]
            if len(at) == 1:
                k, v = rows[0][0][None], rows[0][1][None]
            else:
                k, v = mx.stack([r[0] for r in rows]), mx.stack([r[1] for r in rows])
            for i in run:
                a, b = ranges[i][0] - lo, ranges[i][1] - lo
                if b - a == hi - lo:
                    blocks[i].append(chunks.Block(at, k, v))
                else:  # several layers: a part is strided, so contiguous copies it
                    blocks[i].append(chunks.Block(at, mx.contiguous(k[:, a:b]),
                                                  mx.contiguous(v[:, a:b])))
    return [Rows(lo, hi - lo, layers, tuple(b)) for (lo, hi), b in zip(ranges, blocks)]


def _adjacent(ranges: List[Tuple[int, int]], order: List[int]) -> List[List[int]]:
    """``order`` (indices of ranges, ascending) in runs of adjacent ranges."""
    runs: List[List[int]] = []
    for i in order:
        if runs and ranges[runs[-1][-1]][1] == ranges[i][0]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
