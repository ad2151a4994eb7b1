"""The shape of a Muse-style model's KV state, and what it costs in bytes.

Every byte figure in this project is derived here, from integers, never
measured: a sliding RoPE layer owns ``min(context, window)`` rows, a global NoPE
layer owns ``context`` rows, and one row is ``kv_heads * head_dim`` 2-byte
elements (f16, or bf16 for a bf16 model) per plane, two planes (K and V) per
layer. The seeds' Table 22.1 falls out of those three facts to the byte, and
the tests hold it there.

A plane *allocates* its rows rounded up to ``ROW_GRANULE`` (256): MLX's CUDA
attention is up to 8x slower at depth when a K/V view's row stride is not a
multiple of 256 (``docs/performance.md``). The logical limits do not move --
a ring still wraps at ``min(context, window)`` rows and a write past
``max_context`` is still refused -- and ``footprint`` reports what is allocated,
which is the formula exactly whenever the row counts are multiples of 256
(the seeds' 2,048 and 131,072 among them).
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field
from typing import Any, Tuple

from muser_kv.core.counts import count, optional_count

#: Bytes per stored element: the live planes are f16 or bf16 on every backend.
PLANE_ITEMSIZE = 2

#: Planes allocate their rows in multiples of this (see the module doc).
ROW_GRANULE = 256


def allocated_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``ROW_GRANULE``."""
    return -(-rows // ROW_GRANULE) * ROW_GRANULE


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

    def __post_init__(self) -> None:
        kinds = tuple(LayerKind(k) for k in self.layer_kinds) or _default_layer_kinds(
            self.num_layers
        )
        object.__setattr__(self, "layer_kinds", kinds)
        for name in ("num_layers", "window", "max_context", "num_heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MuseGeometry.{name} must be a positive int, got {value!r}")
        if len(kinds) != self.num_layers:
            raise ValueError(
                f"MuseGeometry: {self.num_layers} layers but {len(kinds)} layer kinds"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"MuseGeometry: {self.num_heads} query heads is not a multiple of "
                f"{self.kv_heads} KV heads"
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
        """``from_model_args(model.args)``, for a model whose layer list agrees
        with its args (``UnsupportedModel`` otherwise)."""
        args = getattr(model, "args", None)
        if args is None:
            raise UnsupportedModel(
                f"muser-kv needs an mlx-lm model with .args, got {type(model).__name__}: it "
                "serves models with sliding-window and global attention layers "
                f"(layer_types {' / '.join(LAYER_TYPES)})")
        geometry = cls.from_model_args(args, max_context)
        layers = getattr(model, "layers", None)
        if layers is not None and len(layers) != geometry.num_layers:
            raise UnsupportedModel(
                f"{type(model).__name__} has {len(layers)} layers but its args say "
                f"num_hidden_layers {geometry.num_layers}")
        _check_own_plan(model, geometry)
        return geometry

    def plan(self) -> Tuple[Tuple[LayerKind, int | None], ...]:
        """Every layer's kind and window (``None`` for a global layer)."""
        return tuple((k, self.window if k is LayerKind.SLIDING else None)
                     for k in self.layer_kinds)

    def layer_kind(self, layer: int) -> LayerKind:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        return self.layer_kinds[layer]

    @property
    def kv_dim(self) -> int:
        """Halves in one token row of one plane: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes one token costs one layer, K and V together."""
        return 2 * self.kv_dim * PLANE_ITEMSIZE

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
    formula_bytes: int = 0  # one slot by the seeds' formula, nothing rounded up

    @property
    def slot_bytes(self) -> int:
        return self.swa_bytes + self.nope_bytes

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.slots


def footprint(geometry: MuseGeometry, context: int, slots: int = 1) -> Footprint:
    """The seeds' formula, ``(n_swa * min(C, W) + n_nope * C) * row_bytes`` per
    slot, over allocated rows (each row count rounded up to ``ROW_GRANULE``)."""
    context = count(context, "footprint context", minimum=1)
    slots = count(slots, "footprint slots", minimum=1)
    row = geometry.row_bytes
    ring = min(context, geometry.window)
    return Footprint(
        context=context,
        slots=slots,
        swa_bytes=geometry.sliding_layers * allocated_rows(ring) * row,
        nope_bytes=geometry.global_layers * allocated_rows(context) * row,
        per_token_below_window=geometry.num_layers * row,
        per_token_above_window=geometry.global_layers * row,
        formula_bytes=(geometry.sliding_layers * ring + geometry.global_layers * context) * row,
    )


def _own_plan(model: Any) -> Tuple[Tuple[str, int | None], ...] | None:
    """What the model's own ``make_cache()`` builds, layer by layer: ``("sliding",
    window)`` for a ``RotatingKVCache``, ``("global", None)`` for a ``KVCache``,
    ``(class name, None)`` for anything else. A model class without
    ``make_cache`` gets a ``KVCache`` per layer from mlx-lm; ``None`` when the
    model has no layer list either (nothing to compare). The class's method is
    asked, never an ``install``ed one; mlx-lm's caches allocate nothing until
    written, so asking costs no memory."""
    own = getattr(type(model), "make_cache", None)
    if own is None:
        layers = getattr(model, "layers", None)
        return None if layers is None else (("global", None),) * len(layers)
    plan: list = []
    for c in own(model):
        name = type(c).__name__ if type(c).__module__ == _MLX_LM_CACHES else type(c).__qualname__
        if name == "RotatingKVCache":
            plan.append(("sliding", int(c.max_size)))
        elif name == "KVCache":
            plan.append(("global", None))
        else:
            plan.append((f"{type(c).__module__}.{type(c).__qualname__}", None))
    return tuple(plan)


#: the module of mlx-lm's cache classes (named, not imported: core needs no mlx-lm)
_MLX_LM_CACHES = "mlx_lm.models.cache"


def _check_own_plan(model: Any, geometry: MuseGeometry) -> None:
    """Refuse a model whose own ``make_cache()`` disagrees with the plan read
    from its args: a list built from a wrong plan would attend over the wrong
    rows, silently (the guard for models whose plan is not read from the model)."""
    own = _own_plan(model)
    if own is None:
        return
    ours = tuple(("sliding", w) if k is LayerKind.SLIDING else ("global", None)
                 for k, w in geometry.plan())
    if own == ours:
        return
    if len(own) != len(ours):
        detail = f"{len(own)} caches for {len(ours)} layers"
    else:
        layer = next(i for i, (a, b) in enumerate(zip(own, ours)) if a != b)
        detail = (f"layer {layer}: the model's make_cache() gives {_describe(own[layer])}, "
                  f"its args say {_describe(ours[layer])}")
    raise UnsupportedModel(
        f"{type(model).__name__} ({_args_name(getattr(model, 'args', None))}): its own "
        f"make_cache() disagrees with the layer plan muser-kv reads from its args ({detail}); "
        "muser-kv serves a model only when it knows which layers are sliding-window and which "
        "global")


def _describe(entry: Tuple[str, int | None]) -> str:
    kind, window = entry
    if kind == "sliding":
        return f"a sliding window of {window}"
    if kind == "global":
        return "a global cache"
    return f"a {kind}"
