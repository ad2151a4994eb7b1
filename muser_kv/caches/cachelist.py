"""The caches of one list: what they share, and the rules a list keeps.

mlx-lm hands a model one cache per layer, as a list, and drives the list in
ways no single cache sees whole: a forward asks each layer type's first cache
for a mask, then writes every layer in list order; ``trim_prompt_cache`` calls
``trim(n)`` on every layer in list order; ``zip`` pairs the list with the
model's layers and stops silently at the shorter. The caches of one list
(``make_prompt_cache`` / ``make_cache_for``) therefore share a ``CacheList``,
and every layer knows its place in it.

Invariants, each with a test (``tests/caches/test_cache_list.py``):

* **In step, or refused.** Layer 0 writes only when the list's last layer is
  at its position (the previous write reached every layer); layer ``i > 0``
  writes ``n`` tokens only when layer ``i - 1`` is exactly ``n`` ahead (it has
  just taken the same write). So a list is either in step -- every layer at one
  position -- or part-way through one write or one trim (a prefix of layers
  ``n`` apart from the rest), and any other write -- after a model with fewer
  layers left the tail behind, or to one layer alone -- raises
  ``CacheOutOfStep`` before anything changes. The check reads one neighbour's
  position: O(1) per write, on the decode fast path too.
* **A trim over a list is all or nothing**, whatever order its layer kinds
  come in. The first ``trim(n)`` of a round checks every layer first: each one
  still to move can remove ``n`` tokens exactly, and every other is already
  where the round ends. Only then does any layer change; the rest of the round
  trims the layers it checked.
* **A model that does not fit the list, or is handed less than the whole
  list, is refused before a layer writes.** ``make_mask`` on the list's first
  cache, asked through mlx-lm's ``create_attention_mask`` (as mlx-lm's models
  ask), finds the model that asked -- the frame above, with ``self`` and the
  ``cache`` list in hand (``_masks(self, h, cache)`` in Muse Glimmer) -- and
  refuses a layer count or layer pattern other than the list's, and a handed
  sequence that is not the list whole and in order (a slice ``c[:4]``, a
  reordering, caches of two lists), every forward: a model once found to fit
  is remembered, the handed sequence is compared each time (``CacheListMismatch``).
  A slice that leaves out layer 0 never asks layer 0 for a mask: it asks a
  cache that is not its kind's first, which a forward over the whole list
  never does, and that cache refuses it the same way (``check_asked``). A
  caller that drives the caches itself is caught by the first rule: a run
  over fewer layers than the list is refused at the next write; one over more
  layers than the list never reaches a cache at all, so nothing in the cache
  protocol can see it.
  Whatever else hands the list on as a unit -- a session save, a store put, a
  restore -- asks ``check_whole`` first.
* **The list knows its model** (a weak reference, when it was built from one):
  a session saved from it records that model's fingerprint.

A list holds its caches by weak reference and a cache holds only its
neighbour's *ring*, so dropping the list frees every plane at once (no
reference cycle waits for the garbage collector).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, List, Optional, Sequence, Tuple

from muser_kv.core.ring import CacheDiscontinuity


class CacheOutOfStep(CacheDiscontinuity):
    """A write to a layer whose list is not where that write belongs: the list's
    layers disagree on their position (``positions``, in list order).
    ``expected`` is where this layer would have to be for the list to be in
    step, ``got`` where it is."""

    def __init__(self, layer: int, expected: int, got: int, positions: Sequence[int],
                 why: str = ""):
        super().__init__(layer, expected, got)
        self.positions = tuple(positions)
        self.why = why
        self.args = (
            f"KV cache list out of step: layer {layer} is at position {got}{why} (positions by "
            f"layer: {list(self.positions)}); a list whose layers disagree refuses every write "
            "until it is back in step",)

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return type(self), (self.layer, self.expected, self.got, self.positions, self.why)


class CacheListMismatch(ValueError):
    """A cache list handed to a model it was not built for (another layer count
    or layer pattern), or handed on as less than the whole list (a slice)."""


#: the code of mlx-lm's ``create_attention_mask``, once mlx-lm is imported
_MASK_HELPER: List[Any] = [None]


def _mask_helper() -> Any:
    """``mlx_lm.models.base.create_attention_mask``'s code, if mlx-lm is loaded
    (never imported from here: a process without mlx-lm has no such model)."""
    base = sys.modules.get("mlx_lm.models.base")
    helper = getattr(getattr(base, "create_attention_mask", None), "__code__", None)
    _MASK_HELPER[0] = helper
    return helper


#: frames between a cache's ``make_mask`` and mlx-lm's ``create_attention_mask``
#: that the model lookup looks through: a wrapper cache (or a few) in between
#: keeps every check on
WRAPPERS = 4


def _model_frame() -> Any:
    """The frame of the model asking for a mask: the one above mlx-lm's
    ``create_attention_mask`` (how mlx-lm's models ask), found among the few
    frames above ``make_mask`` (``WRAPPERS``); its ``self`` and ``cache`` are
    the model and the sequence it was handed. ``None`` when the mask is asked
    otherwise (a custom driver, left to the in-step rule)."""
    helper = _MASK_HELPER[0] or _mask_helper()
    if helper is None:
        return None
    frame: Any = sys._getframe(1)  # the CacheList method; then make_mask, within a method or not
    for _ in range(WRAPPERS + 3):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code is helper:
            return frame.f_back
    return None


def _kinds(caches: Sequence[Any]) -> List[str]:
    return [str(getattr(getattr(c, "kind", None), "value", "?")) for c in caches]


class CacheList:
    """What the caches of one list share: their order, the trim round in
    progress, and the model they were built for."""

    def __init__(self, caches: Sequence[Any], model: Any = None, model_layers: int = 0):
        self._members = [weakref.ref(c) for c in caches]
        #: the layers of the model the list is for: more than its caches where
        #: some layers keep none (Gemma 4's KV-shared layers)
        self.model_layers = model_layers or len(self._members)
        self._model = weakref.ref(model) if model is not None else None
        self._round: Optional[Tuple[int, int, set]] = None  # (from, n, indices still to trim)
        self._fits: Optional[weakref.ref] = None  # the last model seen to fit

    def __len__(self) -> int:
        return len(self._members)

    @property
    def model(self) -> Any:
        """The model the list was built for, if it is known and still alive."""
        return self._model() if self._model is not None else None

    def caches(self) -> List[Any]:
        """The caches still alive, in list order."""
        return [c for c in (r() for r in self._members) if c is not None]

    def positions(self) -> List[int]:
        return [c.offset for c in self.caches()]

    def is_whole(self, handed: Sequence[Any]) -> bool:
        """Whether ``handed`` is this list's caches, every one, in list order
        (padded with ``None`` after them where the model's later layers keep no
        cache: Gemma 4). Compared by identity, since every forward asks; where
        that fails, an entry that stands in for the cache at its place (a
        wrapper that hands on its ``cache_list`` and ``layer``) counts as that
        cache."""
        members = self._members
        n = len(members)
        if len(handed) < n:
            return False
        for r, c in zip(members, handed):  # a loop, not all(...): no generator per forward
            mine = r()
            if c is not mine and (mine is None or getattr(c, "cache_list", None) is not self
                                  or getattr(c, "layer", None) != mine.layer):
                return False
        return len(handed) == n or all(x is None for x in handed[n:])

    def check_whole(self, handed: Sequence[Any], what: str) -> None:
        """Refuse (``CacheListMismatch``) to hand ``handed`` on as this list
        unless it is the whole list in order (``is_whole``): ``what`` names the
        operation refused. A slice would run, save or store part of a list as if
        it were all of it."""
        if self.is_whole(handed):
            return
        mine = self.caches()
        index = {id(c): i for i, c in enumerate(mine)}
        got = [index.get(id(c), "other" if c is not None else None) for c in handed]
        raise CacheListMismatch(
            f"{what}: handed {len(handed)} caches (list indices {got}) of a KV cache list of "
            f"{len(self._members)} ({', '.join(_kinds(mine))}): a slice or a rearrangement of "
            "a list is refused before anything is written; hand the whole list, in order")

    # -- writes -----------------------------------------------------------------

    def out_of_step(self, cache: Any, n: int) -> CacheOutOfStep:
        """The error for ``cache`` refusing a write of ``n`` tokens."""
        index = cache.list_index
        ahead = cache.predecessor_end
        positions = self.positions()
        if index == 0:
            why = (f", the list's last layer at {ahead}: the previous write has not reached "
                   "every layer")
            return CacheOutOfStep(cache.layer, ahead, cache.offset, positions, why)
        before = self._members[index - 1]()
        name = before.layer if before is not None else index - 1
        why = (f": a write of {n} here follows layer {name} to {cache.offset + n}, but layer "
               f"{name} is at {ahead}")
        return CacheOutOfStep(cache.layer, ahead - n, cache.offset, positions, why)

    # -- trims --------------------------------------------------------------------

    def before_trim(self, cache: Any, n: int) -> None:
        """Refuse ``cache.trim(n)`` unless the whole list can take the same trim
        (see the module doc); record the round so its other layers pass in O(1)."""
        start = cache.offset
        r = self._round
        if r is not None and r[0] == start and r[1] == n and cache.list_index in r[2]:
            r[2].discard(cache.list_index)
            if not r[2]:
                self._round = None
            return
        pending = set()
        members = self.caches()
        for c in members:
            at = c.offset
            if at == start:
                depth = c.trimmable_depth()
                if depth < n:
                    raise ValueError(
                        f"layer {c.layer}: can trim at most {depth} tokens exactly, asked for {n} "
                        f"(by a trim of layer {cache.layer}; refused before any layer of the "
                        "list changed)")
                pending.add(c.list_index)
            elif at != start - n:
                raise CacheOutOfStep(
                    c.layer, start, at, [m.offset for m in members],
                    f": a trim of {n} from {start} (layer {cache.layer}) needs every layer at "
                    f"{start} or {start - n}")
        pending.discard(cache.list_index)
        self._round = (start, n, pending) if pending else None

    def forget_round(self) -> None:
        """A restore replaced the list's contents: no trim round carries over."""
        self._round = None

    # -- the model ----------------------------------------------------------------

    def check_caller(self) -> None:
        """Refuse a model whose layers do not fit this list, when the model is
        found computing its masks with the list in hand (see the module doc):
        when ``make_mask`` was called by mlx-lm's ``create_attention_mask`` (how
        mlx-lm's models ask for masks), directly or through a wrapper or a few,
        the model's frame is the one above it, and its ``self`` and ``cache``
        are read (``_model_frame``); a model once found to fit is remembered,
        but the sequence it hands is compared with the list every time (a
        slice of a used list is refused as a fresh one's is). Any other caller
        (a custom driver) costs a few frame lookups and is left to the in-step
        rule."""
        frame = _model_frame()
        if frame is None:
            return
        local = frame.f_locals
        owner, handed = local.get("self"), local.get("cache")
        layers = getattr(owner, "layers", None)
        if not isinstance(handed, (list, tuple)) or layers is None:
            return
        fits = self._fits
        if fits is not None and fits() is owner and self.is_whole(handed):
            return
        layers = list(layers)
        if len(layers) == self.model_layers:  # the list's model, handed part of the list?
            self.check_whole(handed, f"{type(owner).__name__}'s forward")
        self._check_model(owner, layers, handed)
        self._fits = weakref.ref(owner)

    def check_asked(self) -> None:
        """A cache that is not its kind's first in this list, asked for a mask.
        In a model's forward over the whole list only each kind's first cache
        is asked (mlx-lm's models ask ``cache[first index of the kind]``), so a
        model asking this one holds a sequence in which it comes first: a slice
        without the list's head, or a rearrangement, refused here unless the
        sequence is the whole list (a model that asks other caches too). Found
        as ``check_caller`` finds the model; any other caller (a custom driver)
        is left to the in-step rule. Costs nothing in a forward over the whole
        list."""
        frame = _model_frame()
        if frame is None:
            return
        handed = frame.f_locals.get("cache")
        if isinstance(handed, (list, tuple)) and not self.is_whole(handed):
            owner = frame.f_locals.get("self")
            self.check_whole(handed, f"{type(owner).__name__}'s forward")

    def _check_model(self, owner: Any, layers: List[Any], handed: Sequence[Any]) -> None:
        mine = len(self._members)
        # a model whose later layers keep no cache pads the list it was handed
        # with None for them (Gemma 4)
        while len(handed) > mine and handed[-1] is None:
            handed = handed[:-1]
        if len(layers) != self.model_layers or len(handed) != mine:
            raise CacheListMismatch(
                f"KV cache list built for {mine} caches ({', '.join(_kinds(self.caches()))}) of a "
                f"{self.model_layers}-layer model, handed as a list of {len(handed)} to a model "
                f"with {len(layers)} layers ({type(owner).__name__}): mlx-lm's zip would run "
                f"only {min(len(layers), len(handed))} of them; build the cache for this model "
                "(muser_kv.make_prompt_cache(model))")
        if len(layers) != mine:
            return  # layers and caches do not pair one to one
        for i, (layer, c) in enumerate(zip(layers, handed)):
            want = getattr(getattr(layer, "self_attn", None), "layer_type", None)
            kind = getattr(getattr(c, "kind", None), "value", None)
            if want is not None and kind is not None and want != kind:
                types = [getattr(getattr(x, "self_attn", None), "layer_type", "?") for x in layers]
                raise CacheListMismatch(
                    f"KV cache list: layer {i} is a {kind} cache, the model's layer {i} is "
                    f"{want} (model layer types {types}, "
                    f"cache kinds {_kinds(handed)}); build the cache for this model "
                    "(muser_kv.make_prompt_cache(model))")


def bind(caches: Sequence[Any], model: Any = None, model_layers: int = 0) -> CacheList:
    """Make ``caches`` (in list order) one list: each layer learns its index,
    its predecessor's ring (the last layer's, for layer 0) and whether it is
    its kind's first (a cache a model asks for a mask before a forward; the
    list's first cache also looks for the model, once per forward)."""
    group = CacheList(caches, model, model_layers)
    seen = set()
    for i, c in enumerate(caches):
        # layer 0's predecessor is the last layer (a ring is one object for life)
        c.join(group, i, caches[i - 1].ring, c.kind not in seen)
        seen.add(c.kind)
    return group


def adopt(cache: Any) -> Optional[CacheList]:
    """Bind the list a model hands ``cache`` when ``cache`` was rebuilt alone
    (``from_state``: mlx-lm's ``load_prompt_cache`` rebuilds a list one cache at
    a time and never tells them they are one), so a restored list keeps every
    rule of the module doc from its first forward on. The list is found as
    ``CacheList.check_caller`` finds the model; it is bound only when it holds
    ``cache`` and every member is a muser-kv cache of no list. Returns the
    list, or ``None`` (a custom driver: the cache stays a list of one)."""
    frame = _model_frame()
    if frame is None:
        return None
    handed = frame.f_locals.get("cache")
    if not isinstance(handed, (list, tuple)) or not any(c is cache for c in handed):
        return None
    # a model whose later layers keep no cache pads the list with None for them
    # (Gemma 4): those layers are the model's, the caches before them the list's
    caches = list(handed)
    while caches and caches[-1] is None:
        caches.pop()
    if not all(hasattr(c, "ring") and hasattr(c, "join") and c.cache_list is None
               for c in caches):
        return None
    # without padding a rebuilt list takes its own length as its model's: a list
    # cut short is refused at its first forward, never run short
    return bind(caches, model_layers=len(handed))
