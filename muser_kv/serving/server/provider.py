"""``muser-kv serve``'s model provider: mlx-lm's ``ModelProvider`` with
muser-kv's caches on every model it loads, the loaded model's limits for the
request checks, and the checks a server runs on its model before it starts
(``check_model``, ``check_budget``)."""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, List, Optional, Sequence

from muser_kv.caches.growing import GlobalKVCache
from muser_kv.caches.sliding import SlidingKVCache
from muser_kv.core.geometry import MuseGeometry, UnsupportedModel
from muser_kv.core.kernels import detect
from muser_kv.serving.install import context_for, install, installed, vocab_size
from muser_kv.serving.server import mlx_lm_server as mlx
from muser_kv.serving.server.kv_budget import SequencePlanes
from muser_kv.serving.server.request_checks import Limits, ModelKey
from muser_kv.serving.server.serve_flags import ATTENTION
from muser_kv.serving.server.warm_up import warm_up

log = logging.getLogger("muser_kv.serving.server.serve")  # serve's: one logger for the server


class ServeRefused(Exception):
    """The server cannot start with these arguments (one line says why)."""


def check_model(path: str, max_context: Optional[int]) -> Optional[MuseGeometry]:
    """The geometry muser-kv would give the model at ``path``, from its
    ``config.json`` alone (no weights read), so the server refuses a model it
    cannot serve before it starts rather than in its generation thread. Raises
    ``ServeRefused`` naming what is missing; ``None`` for a custom architecture
    (``model_file``), which only its load can tell."""
    try:
        local = mlx.config_dir(path)
        config = mlx.load_config(local)
        if config.get("model_file"):
            return None
        model_class, args_class = mlx.model_classes(config)
        # the model's own code holds its layer plan; its weights stay unevaluated
        model = model_class(args_class.from_dict(config))
        return MuseGeometry.from_model(model, context_for(model, local, max_context))
    except Exception as e:  # whatever it is, mlx-lm's load would not serve it either
        raise ServeRefused(f"{path}: {e}") from e


def sequence_planes(models: Sequence[Any], prefill_step: int) -> Optional[SequencePlanes]:
    """What one sequence's planes cost, over every model whose caches are
    muser-kv's (``install``ed): ``None`` when none is."""
    parts = [SequencePlanes.of(MuseGeometry.from_model(m, i.max_context), prefill_step)
             for m, i in ((m, installed(m)) for m in models if m is not None) if i is not None]
    if not parts:
        return None
    return SequencePlanes(sum(p.ring_bytes for p in parts), sum(p.row_bytes for p in parts),
                          min(p.max_context for p in parts), prefill_step,
                          max(p.layer_row_bytes for p in parts),
                          max(p.layer_ring_bytes for p in parts))


def check_budget(budget: int, planes: SequencePlanes) -> None:
    """Refuse a ``--kv-memory`` below one sequence's planes at their smallest."""
    least = planes.bytes(1) + planes.transient(1, 1)
    if budget < least:
        raise ServeRefused(f"--kv-memory {budget:,} is less than one sequence's KV planes at "
                           f"their smallest ({least:,} bytes): no request could be admitted")


class MuseModelProvider(mlx.server.ModelProvider):
    """mlx-lm's ``ModelProvider``: every model it loads gets muser-kv's caches
    (``install``). The model must be one muser-kv serves (``UnsupportedModel``
    otherwise, and the load is undone). A draft model that muser-kv serves
    gets them too, one that is not keeps mlx-lm's: the target model verifies
    every drafted token, so a draft's caches decide only how many are accepted.
    When a draft model is loaded, ``retain`` is raised to ``--num-draft-tokens``
    so every rollback ``speculative_generate_step`` asks for is exact."""

    def __init__(self, cli_args: argparse.Namespace):
        super().__init__(cli_args)
        self.limits: Optional[Limits] = None  #: the loaded model's; ``None`` while none is
        #: called with each model loaded without a draft model, before it serves
        self.on_load: List[Callable[[Any], None]] = []
        #: a model is loaded with muser-kv's caches and its hooks have run: what
        #: ``/health`` waits for, so a request never waits for a load it did not ask
        #: for (mlx-lm loads ``--model`` in its generation thread, after /health
        #: already answers 200)
        self.ready = cli_args.model is None
        attention = getattr(cli_args, "cuda_attention", None)
        if attention is not None and detect() == "cuda":
            log.info("muser-kv serve: attention on MLX CUDA: %s", ATTENTION[attention])
        if cli_args.model is not None:
            geometry = check_model(cli_args.model, cli_args.max_context)
            budget = getattr(cli_args, "kv_memory", None)
            if budget is not None and geometry is not None:
                check_budget(budget, SequencePlanes.of(geometry, cli_args.prefill_step_size))

    def reset(self) -> None:
        self.limits = None
        super().reset()

    def model_key_for(self, model_path: str, adapter_path: Optional[str] = None,
                      draft_model_path: str = "default_model") -> ModelKey:
        """The ``model_key`` mlx-lm's ``load`` gives a request's names (its mapping,
        0.32.2): whether the request is for the model ``limits`` describes."""
        return mlx.model_key_for(self, model_path, adapter_path, draft_model_path)

    def _install(self, model: Any, drafts: Optional[int], path: Any = None) -> Any:
        a = self.cli_args
        context = context_for(model, self._local(path), a.max_context) if path else a.max_context
        return install(model, max_context=context, retain=a.retain,
                       plane_dtype=a.plane_dtype, num_draft_tokens=drafts,
                       sliding_layout=a.sliding_layout)

    @staticmethod
    def _local(path: Any) -> Any:
        try:
            return mlx.config_dir(path)
        except Exception:  # no local config: install decides
            return path

    def _load(self, model_path: str, adapter_path: Optional[str] = None,
              draft_model_path: Optional[str] = None) -> None:
        self.ready = False
        super()._load(model_path, adapter_path, draft_model_path)
        try:
            drafts = self.cli_args.num_draft_tokens if self.draft_model is not None else None
            self._install(self.model, drafts, model_path)
            if self.draft_model is not None:
                try:
                    self._install(self.draft_model, drafts, draft_model_path)
                except UnsupportedModel as e:
                    log.info("muser-kv serve: the draft model keeps mlx-lm's caches (%s)", e)
            contexts = [i.max_context for i in map(installed, (self.model, self.draft_model))
                        if i is not None]
            loaded: Any = self  # what mlx-lm's load set (its __init__ types them None)
            planes = sequence_planes((self.model, self.draft_model),
                                     self.cli_args.prefill_step_size)
            budget = getattr(self.cli_args, "kv_memory", None)
            if budget is not None and planes is not None:
                check_budget(budget, planes)
            self.limits = Limits(loaded.model_key, loaded.tokenizer, min(contexts),
                                 vocab_size(loaded.model), planes)
        except Exception:
            self.reset()  # no model is left serving without muser-kv's caches
            raise
        warm_up(self.model)
        if self.draft_model is None:
            for hook in self.on_load:
                hook(self.model)
        # mlx-lm decided batchability on its own caches; these are muser-kv's,
        # which all merge (muser_kv.batch): mlx-lm's other rule, no draft model,
        # is what remains. Decided without building a cache (one with
        # preallocated planes is 1.8 GB at 131k).
        self.is_batchable = self.draft_model is None and all(
            hasattr(cls, "merge") for cls in (SlidingKVCache, GlobalKVCache))
        self.ready = True
