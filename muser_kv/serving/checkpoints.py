"""Checkpoints inside long prompts: the KV store puts a prompt's state at every
multiple of an interval its prefill passes, so an edit anywhere in a long
prompt (a document, then a question) is rebuilt from the deepest checkpoint at
or below it instead of prefilled from the start.

A position is rebuildable when the store holds the global rows of every
position before it and the sliding rows of the window before it; a ring holds
only its last ``window`` rows, so those must be put while the prefill passes
(``docs/store.md``). The positions are absolute multiples of the interval, so
the same prefix always gives the same checkpoints, whoever sent it.

* **Server** (``muser-kv serve --kv-store-checkpoint N``): mlx-lm's batched
  path ends a prefill step at every segment boundary of a prompt, extracts the
  sequence's cache there and inserts it into the prompt cache with that
  segment's type (``mlx_lm/server.py`` 0.32.2). ``split_segments`` cuts
  mlx-lm's segments further at the checkpoints, each new boundary of type
  ``CHECKPOINT``; ``ExactPromptCache.insert_cache`` puts such a list into the
  store only, never keeping it as an entry. The one-at-a-time path (a draft
  model, a request with a seed) has no segments: no checkpoints there.
* **Commands** (``muser-kv generate`` / ``chat --kv-store``): they prefill the
  prompt less its last token themselves and put at every checkpoint on the way
  (``prefill_pieces``).
"""

from __future__ import annotations

import argparse
from typing import List, Sequence, Tuple

from muser_kv.sessions.store.chunks import CHUNK

#: the segment type of a boundary that is only a checkpoint (a type names the
#: cache at the END of its segment, as mlx-lm's server pops them)
CHECKPOINT = "checkpoint"

#: the default interval, in tokens
DEFAULT_CHECKPOINT = 8192


def checkpoint_interval(text: str) -> int:
    """``--kv-store-checkpoint``'s type: 0 (off) or a positive multiple of the
    store's chunk (256 tokens), so every checkpoint is a chunk boundary."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0 or a multiple of {CHUNK}, got {text!r}") from None
    if value < 0 or value % CHUNK:
        raise argparse.ArgumentTypeError(
            f"expected 0 (no checkpoints) or a positive multiple of {CHUNK} (the KV store's "
            f"chunk), got {value}")
    return value


def checkpoints(start: int, end: int, interval: int) -> List[int]:
    """The multiples of ``interval`` strictly between ``start`` and ``end``
    (none when ``interval`` is 0)."""
    if interval <= 0:
        return []
    first = (start // interval + 1) * interval
    return list(range(first, end, interval))


def split_segments(segments: Sequence[Sequence[int]], types: Sequence[str],
                   interval: int) -> Tuple[List[List[int]], List[str]]:
    """mlx-lm's segments of one prompt, cut further at every absolute position
    that is a multiple of ``interval``, inside a segment and short of the
    prompt's last token (mlx-lm splits that token off itself and inserts the
    cache before it with the last segment's type). Each new boundary has type
    ``CHECKPOINT``; the original boundaries keep theirs, the last segment stays
    last. ``interval`` 0 gives the segments back unchanged."""
    out: List[List[int]] = []
    kinds: List[str] = []
    total = sum(len(s) for s in segments)
    at = 0
    for segment, kind in zip(segments, types):
        segment = list(segment)
        lo = at
        for cut in checkpoints(at, min(at + len(segment), total - 1), interval):
            out.append(segment[lo - at:cut - at])
            kinds.append(CHECKPOINT)
            lo = cut
        out.append(segment[lo - at:])
        kinds.append(kind)
        at += len(segment)
    return out, kinds


def prefill_pieces(start: int, end: int, interval: int) -> List[Tuple[int, int]]:
    """``[start, end)`` in pieces that end at each checkpoint it passes (and at
    ``end``); the caller puts the state after every piece but the last."""
    cuts = checkpoints(start, end, interval) + [end]
    pieces, lo = [], start
    for cut in cuts:
        if cut > lo:
            pieces.append((lo, cut))
        lo = cut
    return pieces
