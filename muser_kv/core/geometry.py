"""The shape of a Muse-style model's KV state, and what it costs in bytes.

Every byte figure in this project is derived here, from integers, never
measured: a sliding RoPE layer owns ``min(context, window)`` rows, a global NoPE
layer owns ``context`` rows, and one row is ``kv_heads * head_dim`` 2-byte
elements (f16, or bf16 for a bf16 model) per plane, two planes (K and V) per
layer. Every footprint follows from those three facts to the byte, and the
tests hold it there.

A plane *allocates* its rows rounded up to ``ROW_GRANULE`` (256): MLX's CUDA
attention is up to 8x slower at depth when a K/V view's row stride is not a
multiple of 256 (``docs/performance.md``). The logical limits do not move --
a ring still wraps at ``min(context, window)`` rows and a write past
``max_context`` is still refused -- and ``footprint`` reports what is allocated,
which is the formula exactly whenever the row counts are multiples of 256
(2,048 and 131,072 among them).
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

from muser_kv.core.counts import count, optional_count
from muser_kv.core.probe import cache_uses, own_caches

#: Bytes per stored element: the live planes are f16 or bf16 on every backend.
PLANE_ITEMSIZE = 2

#: Planes allocate their rows in multiples of this (see the module doc).
ROW_GRANULE = 256


def allocated_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``ROW_GRANULE``."""
    return -(-rows // ROW_GRANULE) * ROW_GRANULE


def compact_rows(live: int, capacity: int) -> int:
    """The smallest allocation that holds ``live`` rows: ``live`` rounded up to
    ``ROW_GRANULE`` (one granule at least), never more than the preallocated
    ``allocated_rows(capacity)``. What a list that is kept, not written, holds
    (a prompt-cache entry, ``Planes.fit``); its next write moves it to
    ``canonical_rows``."""
    return min(allocated_rows(max(live, 1)), allocated_rows(capacity))


def canonical_rows(live: int, capacity: int) -> int:
    """The allocation of a growing plane whose live rows are ``live`` when
    attention reads it: ``ROW_GRANULE`` times the smallest power of two that
    holds them, never more than the preallocated ``allocated_rows(capacity)``.

    It is a function of the live rows alone because MLX's CUDA attention picks
    its kernel by the strides of the views it is handed, and a head-major
    plane's head stride is its allocation: two lists holding the same rows in
    other allocations would run other kernels and give other bits. Every path
    that builds or writes planes (decode, prefill, install, merge, extract,
    a write after a trim or after ``fit``) lands here, so a list gives the same
    logits however it came to its position. Doubling from one granule reaches
    the same values, so decode grows with one bitwise copy per doubling; the
    cost is up to twice the live rows allocated."""
    limit = allocated_rows(capacity)
    if live > limit:
        raise ValueError(f"a plane of capacity {capacity} holds at most {limit} rows, "
                         f"asked for {live}")
    rows = ROW_GRANULE
    while rows < live:
        rows *= 2
    return min(rows, limit)


def canonical_span(rows: int, capacity: int) -> Tuple[int, int]:
    """``(low, high)`` such that ``canonical_rows(n, capacity) == rows`` exactly
    when ``low < n <= high``; ``(0, 0)`` when ``rows`` is no canonical
    allocation (a compact one). Lets a write check its allocation with two
    comparisons."""
    limit = allocated_rows(capacity)
    low, high = 0, ROW_GRANULE
    while high < min(rows, limit):
        low, high = high, high * 2
    if rows == limit:
        return low, limit
    return (low, rows) if high == rows else (0, 0)


class LayerKind(str, enum.Enum):
    """The two storage regimes a Muse layer can need."""

    #: Sliding-window RoPE layer: a bounded ring of ``min(max_context, window)`` rows.
    SLIDING = "sliding_attention"
    #: Global NoPE layer: a growing, head-major plane of ``max_context`` rows.
    GLOBAL = "full_attention"


#: The ``layer_types`` values muser-kv serves, one per storage regime.
LAYER_TYPES = tuple(k.value for k in LayerKind)

#: The integer model fields ``from_model_args`` cannot do without.
_REQUIRED = ("num_hidden_layers", "num_attention_heads", "sliding_window", "max_position_embeddings")


class UnsupportedModel(TypeError):
    """A model muser-kv cannot build a cache for: names the field that is missing
    or the layer type it does not serve."""


def _args_name(args: Any) -> str:
    kind = getattr(args, "model_type", None)
    return f"the model's args ({type(args).__name__}{f', model_type {kind!r}' if kind else ''})"


def _model_int(args: Any, name: str) -> int | None:
    """An integer field of the model's args; None when absent or None; a field
    of another type is refused by name."""
    value = getattr(args, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise UnsupportedModel(f"{_args_name(args)}: {name} expected a positive int, got {value!r}")
    return int(value)


def _layer_kinds(args: Any, num_layers: int) -> Tuple[LayerKind, ...]:
    """``layer_types`` as layer kinds. Args without them are refused: which
    layers are global is read from the model, never guessed (Gemma 3's args
    have ``sliding_window_pattern`` instead, and Muse Glimmer's ``i % 4 == 3``
    put its global layers in the wrong places)."""
    types = getattr(args, "layer_types", None)
    if not types:
        raise UnsupportedModel(
            f"{_args_name(args)} has no layer_types: muser-kv reads which layers are "
            f"sliding-window and which are global from layer_types ({' / '.join(LAYER_TYPES)}) "
            "and will not guess a layer plan")
    types = list(types)
    unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if unknown:
        raise UnsupportedModel(
            f"{_args_name(args)}: layer_types has {unknown}; muser-kv serves sliding-window "
            f"and global attention layers only (layer_types {' / '.join(LAYER_TYPES)})")
    if len(types) != num_layers:
        raise UnsupportedModel(
            f"{_args_name(args)}: {len(types)} layer_types for {num_layers} layers")
    return tuple(LayerKind(t) for t in types)


def _default_layer_kinds(num_layers: int) -> Tuple[LayerKind, ...]:
    # Muse Glimmer's partition rule: layer i is global NoPE iff i % 4 == 3.
    return tuple(
        LayerKind.GLOBAL if i % 4 == 3 else LayerKind.SLIDING for i in range(num_layers)
    )


#: The ``max_context`` of a list for a model that names no context length (its
#: args carry no ``max_position_embeddings``) when the caller gives none: no
#: preset bound. Every ring then holds its window (``min(max_context, window)``)
#: and every global plane grows for as long as memory lasts; this is only the
#: most rows one plane's row dimension addresses (MLX array dimensions and RoPE
#: offsets are int32), in whole granules, so ``ContextOverflow`` marks the end of
#: addressable positions, never a size anyone chose. Preallocated planes need a
#: real bound (``MuseGeometry.bounded``).
UNBOUNDED_CONTEXT = 2**31 - ROW_GRANULE


@dataclass(frozen=True)
class MuseGeometry:
    """Layer kinds and head geometry; the defaults are Muse Glimmer's.

    ``max_context`` is the capacity a cache is built for: the NoPE planes hold
    exactly that many rows and a write past it is refused, never shifted.
    """

    num_layers: int = 52
    window: int = 2048
    max_context: int = 131072
    num_heads: int = 32
    kv_heads: int = 2
    head_dim: int = 128
    layer_kinds: Tuple[LayerKind, ...] = field(default=())
    #: A global layer's K/V heads and head_dim where they differ from a sliding
    #: layer's (Gemma 4's global layers are wider); 0: the same.
    global_kv_heads: int = 0
    global_head_dim: int = 0
    #: The model's own layer count, where some layers keep no cache of their own
    #: (Gemma 4's KV-shared layers read an earlier layer's); 0: ``num_layers``.
    model_layers: int = 0

    def __post_init__(self) -> None:
        kinds = tuple(LayerKind(k) for k in self.layer_kinds) or _default_layer_kinds(
            self.num_layers
        )
        object.__setattr__(self, "layer_kinds", kinds)
        for name in ("num_layers", "window", "max_context", "num_heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MuseGeometry.{name} must be a positive int, got {value!r}")
        for name in ("global_kv_heads", "global_head_dim", "model_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"MuseGeometry.{name} must be an int >= 0, got {value!r}")
        if len(kinds) != self.num_layers:
            raise ValueError(
                f"MuseGeometry: {self.num_layers} layers but {len(kinds)} layer kinds"
            )
        if self.model_layers and self.model_layers < self.num_layers:
            raise ValueError(f"MuseGeometry: {self.num_layers} caches for a model of "
                             f"{self.model_layers} layers")
        for heads in {self.kv_heads, self.global_kv_heads or self.kv_heads}:
            if self.num_heads % heads:
                raise ValueError(
                    f"MuseGeometry: {self.num_heads} query heads is not a multiple of "
                    f"{heads} KV heads"
                )

    @classmethod
    def from_model_args(cls, args: Any, max_context: int | None = None) -> "MuseGeometry":
        """Read an mlx-lm ``ModelArgs`` (``layer_types``, ``sliding_window``, heads...).

        ``max_context`` overrides ``max_position_embeddings`` (a smaller cache for a
        shorter session); it may not exceed it, since positions past the model's
        limit are not positions the model was built for. Args that lack a field
        muser-kv needs, or name a layer type it does not serve, raise
        ``UnsupportedModel`` naming the field.
        """
        found = {name: _model_int(args, name) for name in _REQUIRED}
        fields = {name: value for name, value in found.items() if value is not None}
        missing = [name for name in _REQUIRED if name not in fields]
        if missing:
            raise UnsupportedModel(
                f"{_args_name(args)} has no {' / '.join(missing)} (missing or None): muser-kv "
                f"serves models with sliding-window and global attention layers, and needs "
                f"{', '.join(_REQUIRED)} and layer_types ({' / '.join(LAYER_TYPES)}) from the "
                "model's args")
        limit = fields["max_position_embeddings"]
        max_context = optional_count(max_context, "max_context", minimum=1)
        if max_context is None:
            max_context = limit
        elif max_context > limit:
            raise ValueError(
                f"max_context {max_context} exceeds the model's max_position_embeddings {limit}"
            )
        num_layers = fields["num_hidden_layers"]
        kinds = _layer_kinds(args, num_layers)
        num_heads = fields["num_attention_heads"]
        head_dim = _model_int(args, "head_dim")
        if head_dim is None:
            hidden = _model_int(args, "hidden_size")
            if hidden is None:
                raise UnsupportedModel(f"{_args_name(args)} has neither head_dim nor hidden_size")
            head_dim = hidden // num_heads
        return cls(
            num_layers=num_layers,
            window=fields["sliding_window"],
            max_context=max_context,
            num_heads=num_heads,
            kv_heads=_model_int(args, "num_key_value_heads") or num_heads,
            head_dim=head_dim,
            layer_kinds=kinds,
        )

    @classmethod
    def from_model(cls, model: Any, max_context: int | None = None) -> "MuseGeometry":
        """The layer plan of ``model``, read off its own code (``muser_kv.core.probe``):
        one entry per cache its ``make_cache()`` builds (Gemma 4's KV-shared layers
        have none), of the kind and window that cache is, with the K/V heads and
        head_dim the model hands it. ``max_context`` defaults to the args'
        ``max_position_embeddings`` and may not exceed it; for a model whose args
        carry none it defaults to ``UNBOUNDED_CONTEXT`` (no preset bound: see
        there). A model muser-kv cannot serve exactly raises
        ``UnsupportedModel`` naming why: no layer list, a cache of another kind
        (chunked attention, recurrent state), attention-sink rows, no sliding
        layer, two windows, K/V shapes that differ within a kind."""
        name = type(model).__name__
        args = _model_args(model)
        if args is None:
            raise UnsupportedModel(
                f"muser-kv needs an mlx-lm model with .args (or .config), got {name}: it "
                "serves models with sliding-window and global attention layers "
                f"(layer_types {' / '.join(LAYER_TYPES)})")
        what = f"{name} ({_args_name(args)})"
        own = own_caches(model)
        if own is None:
            raise UnsupportedModel(f"{what} has neither make_cache() nor a layer list: muser-kv "
                                   "reads a model's layer plan from them")
        fields = _text_args(args)
        if getattr(fields, "layer_types", None):
            _layer_kinds(fields, len(fields.layer_types))  # names a layer type not served
        for i, c in enumerate(own):
            if c.kind not in ("sliding", "global"):
                raise UnsupportedModel(
                    f"{what}: layer {i}'s own cache is a {c.kind}: muser-kv serves layers whose "
                    "cache is mlx-lm's RotatingKVCache (a sliding window) or KVCache (global) "
                    f"only{_why(c.kind)}")
            if c.kind == "sliding" and (isinstance(c.window, bool) or not isinstance(
                    c.window, numbers.Integral) or c.window <= 0):
                raise UnsupportedModel(
                    f"{what}: layer {i}'s RotatingKVCache has max_size {c.window!r}, expected a "
                    "positive int (the sliding window)")
            if c.keep:
                raise UnsupportedModel(
                    f"{what}: layer {i}'s RotatingKVCache keeps {c.keep} attention-sink rows; "
                    "muser-kv's rings keep none")
        layers = getattr(model, "layers", None)
        model_layers = len(layers) if layers is not None else len(own)
        if len(own) > model_layers:
            raise UnsupportedModel(
                f"{what}: its make_cache() builds {len(own)} caches for {model_layers} layers "
                "(some layers run more than once, each time with another cache); muser-kv "
                "serves at most one cache per layer")
        windows = sorted({int(c.window) for c in own if c.kind == "sliding"})
        if not windows:
            raise UnsupportedModel(
                f"{what} has no sliding-window layers (its make_cache() builds "
                f"{len(own)} KVCache): muser-kv serves models with sliding-window and global "
                "attention layers; mlx-lm's own caches serve this one")
        if len(windows) > 1:
            raise UnsupportedModel(f"{what}: sliding layers of windows {windows}; muser-kv "
                                   "serves one window per model")
        kinds = tuple(LayerKind.SLIDING if c.kind == "sliding" else LayerKind.GLOBAL for c in own)
        dims = _handed_dims(model, what, kinds, windows[0])
        limit = _model_int(fields, "max_position_embeddings")
        max_context = optional_count(max_context, "max_context", minimum=1)
        if max_context is None:
            max_context = UNBOUNDED_CONTEXT if limit is None else limit
        elif limit is not None and max_context > limit:
            raise ValueError(
                f"max_context {max_context} exceeds the model's max_position_embeddings {limit}"
            )
        (s_heads, s_dim) = dims.get(LayerKind.SLIDING, dims[LayerKind.GLOBAL])
        (g_heads, g_dim) = dims.get(LayerKind.GLOBAL, (s_heads, s_dim))
        num_heads = _model_int(fields, "num_attention_heads") or max(s_heads, g_heads)
        return cls(
            num_layers=len(own), window=windows[0], max_context=max_context,
            num_heads=num_heads, kv_heads=s_heads, head_dim=s_dim, layer_kinds=kinds,
            global_kv_heads=0 if g_heads == s_heads else g_heads,
            global_head_dim=0 if g_dim == s_dim else g_dim,
            model_layers=0 if model_layers == len(own) else model_layers,
        )

    @property
    def bounded(self) -> bool:
        """Whether ``max_context`` is a bound (the model's or the caller's), not
        ``UNBOUNDED_CONTEXT``: only a bounded geometry can be preallocated."""
        return self.max_context < UNBOUNDED_CONTEXT

    def plan(self) -> Tuple[Tuple[LayerKind, int | None], ...]:
        """Every layer's kind and window (``None`` for a global layer)."""
        return tuple((k, self.window if k is LayerKind.SLIDING else None)
                     for k in self.layer_kinds)

    def layer_kind(self, layer: int) -> LayerKind:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        return self.layer_kinds[layer]

    def dims(self, kind: LayerKind) -> Tuple[int, int]:
        """``(kv_heads, head_dim)`` of a layer of ``kind``."""
        if LayerKind(kind) is LayerKind.GLOBAL:
            return (self.global_kv_heads or self.kv_heads, self.global_head_dim or self.head_dim)
        return (self.kv_heads, self.head_dim)

    def layer_dims(self, layer: int) -> Tuple[int, int]:
        """``(kv_heads, head_dim)`` of ``layer``."""
        return self.dims(self.layer_kind(layer))

    @property
    def uniform(self) -> bool:
        """Whether every layer has the same K/V heads and head_dim."""
        return self.dims(LayerKind.GLOBAL) == self.dims(LayerKind.SLIDING)

    def kind_row_bytes(self, kind: LayerKind) -> int:
        """Bytes one token costs one layer of ``kind``, K and V together."""
        heads, dim = self.dims(kind)
        return 2 * heads * dim * PLANE_ITEMSIZE

    @property
    def kv_dim(self) -> int:
        """Halves in one token row of one plane: ``kv_heads * head_dim`` (every
        layer's: a geometry whose kinds differ has no one row, and refuses)."""
        self._require_uniform("kv_dim")
        return self.kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes one token costs one layer, K and V together (uniform geometries)."""
        self._require_uniform("row_bytes")
        return 2 * self.kv_dim * PLANE_ITEMSIZE

    def _require_uniform(self, what: str) -> None:
        if not self.uniform:
            raise ValueError(f"MuseGeometry.{what}: sliding layers have {self.dims(LayerKind.SLIDING)} "
                             f"and global layers {self.dims(LayerKind.GLOBAL)} (kv_heads, "
                             "head_dim); ask per kind (kind_row_bytes, dims)")

    @property
    def sliding_layers(self) -> int:
        return sum(1 for k in self.layer_kinds if k is LayerKind.SLIDING)

    @property
    def global_layers(self) -> int:
        return self.num_layers - self.sliding_layers

    def capacity(self, layer: int, max_context: int | None = None) -> int:
        """Rows a layer's ring holds: the footprint formula, nothing rounded up."""
        context = self.max_context if max_context is None else max_context
        if self.layer_kind(layer) is LayerKind.SLIDING:
            return min(context, self.window)
        return context

    def allocated(self, layer: int, max_context: int | None = None) -> int:
        """Rows a layer's plane allocates: ``capacity`` rounded up to ``ROW_GRANULE``."""
        return allocated_rows(self.capacity(layer, max_context))


@dataclass(frozen=True)
class Footprint:
    """KV bytes for ``slots`` sessions of ``context`` positions (planes only),
    as allocated (rows rounded up to ``ROW_GRANULE``)."""

    context: int
    slots: int
    swa_bytes: int  # one slot's sliding-layer rings, allocated
    nope_bytes: int  # one slot's global-layer planes, allocated
    per_token_below_window: int  # marginal bytes of one more token, context < window
    per_token_above_window: int  # ... and once the rings have stopped growing
    formula_bytes: int = 0  # one slot by the formula, nothing rounded up

    @property
    def slot_bytes(self) -> int:
        return self.swa_bytes + self.nope_bytes

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.slots


def footprint(geometry: MuseGeometry, context: int, slots: int = 1) -> Footprint:
    """The footprint formula, ``n_swa * min(C, W) * swa_row + n_nope * C * nope_row``
    per slot (one row bytes for both kinds where their heads agree), over
    allocated rows (each row count rounded up to ``ROW_GRANULE``)."""
    context = count(context, "footprint context", minimum=1)
    slots = count(slots, "footprint slots", minimum=1)
    swa = geometry.sliding_layers * geometry.kind_row_bytes(LayerKind.SLIDING)
    nope = geometry.global_layers * geometry.kind_row_bytes(LayerKind.GLOBAL)
    ring = min(context, geometry.window)
    return Footprint(
        context=context,
        slots=slots,
        swa_bytes=allocated_rows(ring) * swa,
        nope_bytes=allocated_rows(context) * nope,
        per_token_below_window=swa + nope,
        per_token_above_window=nope,
        formula_bytes=ring * swa + context * nope,
    )


def _text_args(args: Any) -> Any:
    """The args that describe the language model: a multimodal model's
    ``text`` args (Muse Spark), else the args themselves."""
    text = getattr(args, "text", None)
    return text if text is not None and getattr(args, "num_attention_heads", None) is None else args


def _model_args(model: Any) -> Any:
    """An mlx-lm model's args: ``model.args``, or ``model.config`` where the
    module names them so (PLaMo 3)."""
    args = getattr(model, "args", None)
    return getattr(model, "config", None) if args is None else args


def context_limit(model: Any) -> int | None:
    """The model's ``max_position_embeddings``, where its args carry one."""
    return _model_int(_text_args(_model_args(model)), "max_position_embeddings")


def _why(kind: str) -> str:
    reasons = {"ChunkedKVCache": "chunked attention", "ArraysCache": "recurrent state",
               "MambaCache": "recurrent state", "QuantizedKVCache": "quantized K/V",
               "CacheList": "several caches per layer"}
    for cls, why in reasons.items():
        if kind.endswith("." + cls):
            return f" (this one is {why})"
    return ""


def _handed_dims(model: Any, what: str, kinds: Tuple[LayerKind, ...], window: int
                 ) -> Dict[LayerKind, Tuple[int, int]]:
    """``(kv_heads, head_dim)`` per layer kind, from the K/V the model hands its
    caches in a lazy forward (``probe.cache_uses``); one per kind, or refused.
    Refused too: a forward that masks a sliding layer to another span than its
    ring holds, or reads one layer's cache from another (KV sharing through
    ``keys_and_values()``): a muser-kv cache hands its rows, and the mask that
    describes them, to the layer that writes it, in ``update_and_fetch``."""
    try:
        uses = cache_uses(model, len(kinds))
    except Exception as e:  # the forward itself cannot run here
        raise UnsupportedModel(
            f"{what}: a lazy one-token forward, to read the K/V each layer hands its cache, "
            f"failed on this device ({type(e).__name__}: {e})") from e
    dims: Dict[LayerKind, Tuple[int, int]] = {}
    for i, (kind, use) in enumerate(zip(kinds, uses)):
        if use.read_elsewhere:
            raise UnsupportedModel(
                f"{what}: another layer reads layer {i}'s cache through keys_and_values() (KV "
                "sharing inside the model's forward); muser-kv's caches hand their rows only to "
                "the layer that writes them, through update_and_fetch")
        asked = sorted({w for w in use.mask_windows if w is not None and w != window})
        if kind is LayerKind.SLIDING and asked:
            raise UnsupportedModel(
                f"{what}: the model masks layer {i} to a window of {asked[0]} rows, but its own "
                f"make_cache() gives that layer a RotatingKVCache of {window}: mlx-lm's attention "
                f"span then depends on how a prompt is chunked (a chunk's queries see up to "
                f"{asked[0]} rows, a decoded token {window}), which no ring reproduces exactly")
        h = use.handed
        if h is None:
            raise UnsupportedModel(f"{what}: layer {i}'s cache was handed no keys in a forward")
        if len(h.keys) != 4 or h.keys != h.values:
            raise UnsupportedModel(
                f"{what}: layer {i} hands its cache keys {h.keys} and values {h.values}; "
                "muser-kv stores K and V of one shape [1, kv_heads, N, head_dim]")
        got = (int(h.keys[1]), int(h.keys[3]))
        if dims.setdefault(kind, got) != got:
            raise UnsupportedModel(
                f"{what}: {kind.value} layers hand (kv_heads, head_dim) {dims[kind]} and {got} "
                f"(layer {i}); muser-kv serves one shape per layer kind")
    return dims
