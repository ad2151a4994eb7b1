"""``muser-kv generate`` and ``muser-kv chat``: mlx-lm's own commands, run by
mlx-lm's own ``main()``, on muser-kv caches.

Each command is ``mlx_lm.generate.main()`` / ``mlx_lm.chat.main()`` unchanged:
same flags, same code paths, same output. For the duration of the run, three
attributes of that mlx-lm module are swapped (and restored afterwards):

* ``setup_arg_parser`` returns mlx-lm's own parser plus a "muser-kv" group
  (``--max-context``, ``--retain``, ``--plane-dtype``, ``--session``), so
  mlx-lm parses, checks and documents every flag, ours included;
* ``load`` is mlx-lm's ``load`` followed by ``muser_kv.install`` on the model it
  returns, so mlx-lm's ``make_prompt_cache(model)`` builds muser-kv caches.
  mlx-lm's ``main()`` loads the model first and then, in ``generate``, the
  ``--draft-model``: the first model must be one muser-kv serves (``UnsupportedModel``
  otherwise: one line naming what is missing, exit status 1); a later (draft)
  model gets muser-kv caches when it is one muser-kv serves and keeps mlx-lm's own
  otherwise. With ``--draft-model``, every model muser-kv serves is installed with
  ``num_draft_tokens=--num-draft-tokens``, so each rollback
  ``speculative_generate_step`` asks for is exact past the wrap;
* with ``--kv-store DIR|redis://HOST:PORT``, ``stream_generate`` first asks the
  KV store for the deepest stored point of the prompt (a run of the same long
  prompt again, a chat resumed with its history) and prefills only the rest;
  it puts the prompt less its last token (where a regenerate lands), the
  prompt's state at every multiple of ``--kv-store-checkpoint`` its prefill
  passes (where an edit inside a long prompt lands), and the finished answer
  (``KVStore``, ``docs/store.md``);
* with ``--session FILE``, ``stream_generate`` is mlx-lm's followed by a save of
  the model's cache to FILE once a response is complete (after every chat turn,
  at the end of a generation); if FILE exists, the first cache mlx-lm asks the
  model for holds the session restored from it, bit for bit.

mlx-lm flags whose meaning muser-kv's caches would change are refused before
anything loads: ``--max-kv-size`` (mlx-lm's rotating-cache size, which
mlx-lm's Muse Glimmer ignores; the muser-kv limit is ``--max-context``, which
never drops a token) and ``--kv-bits`` (muser-kv caches are not quantized).
``--prompt-cache-file`` passes through to mlx-lm untouched, except beside
``--session`` (two sources of history: refused). Chat runs in one process only
(a sharded model's per-rank KV heads are not the geometry its args describe).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from muser_kv.caches.base import MuseKVCache
from muser_kv.caches.speculative import DEFAULT_RETAIN
from muser_kv.caches.writes import ContextOverflow
from muser_kv.core.geometry import UnsupportedModel
from muser_kv.serving.arg_types import non_negative, positive
from muser_kv.serving.checkpoints import DEFAULT_CHECKPOINT, checkpoint_interval, prefill_pieces
from muser_kv.serving.install import context_for, install
from muser_kv.sessions.format import SnapshotError
from muser_kv.sessions.reading import read_session
from muser_kv.sessions.save import save_session
from muser_kv.sessions.snapshot import SessionSnapshot, restore_into
from muser_kv.sessions.store import KVStore

#: muser-kv subcommand -> the mlx-lm module whose ``main()`` it runs
COMMANDS: Dict[str, str] = {"generate": "mlx_lm.generate", "chat": "mlx_lm.chat",
                             "cache-prompt": "mlx_lm.cache_prompt"}


class CommandError(Exception):
    """A refusal of ``muser-kv generate`` / ``chat``: what was asked, why it is
    refused and what to pass instead (printed as one line, exit status 1)."""


def build_parser(command: str) -> argparse.ArgumentParser:
    """mlx-lm's own parser for ``command`` with muser-kv's flags added."""
    module = _module(command)
    parser = module.setup_arg_parser()
    parser.prog = f"muser-kv {command}"
    parser.description = (f"mlx-lm's {command} ({COMMANDS[command]}) on muser-kv's exact "
                          f"caches. {parser.description or ''}").strip()
    ours = parser.add_argument_group(
        "muser-kv", "the caches muser_kv.install puts on the model (--max-kv-size is refused: "
                    "use --max-context)")
    ours.add_argument("--max-context", type=positive, default=None, metavar="N",
                      help="tokens the cache holds; a write past it stops with an error, "
                           "nothing is dropped (default: the session file's, else the model's "
                           "max_position_embeddings, else no preset bound)")
    ours.add_argument("--retain", type=non_negative, default=DEFAULT_RETAIN, metavar="N",
                      help="overwritten rows each sliding ring keeps, i.e. how deep a trim is "
                           f"exact past the wrap (default {DEFAULT_RETAIN}; raised to "
                           "--num-draft-tokens with --draft-model)")
    ours.add_argument("--plane-dtype", choices=("float16", "bfloat16"), default=None,
                      help="the planes' type (default: follows the model: bfloat16 for a "
                           "bf16 model, else float16)")
    ours.add_argument("--session", metavar="FILE", default=None,
                      help="a muser-kv session file: resumed from if it exists, written "
                           "(atomically) after every chat turn / at the end of a generation")
    ours.add_argument("--kv-store", metavar="DIR|redis://HOST:PORT", default=None,
                      help="a KV store: the prompt's deepest stored point is rebuilt instead "
                           "of prefilled; prompts and answers are put (docs/store.md)")
    ours.add_argument("--kv-store-bytes", type=non_negative, default=None, metavar="N",
                      help="the --kv-store tier's bound in bytes (default: unbounded)")
    ours.add_argument("--kv-store-checkpoint", type=checkpoint_interval,
                      default=DEFAULT_CHECKPOINT, metavar="N",
                      help="with --kv-store, also put the prompt's state at every multiple of N "
                           "tokens its prefill passes, so an edit inside a long prompt is "
                           "rebuilt from the checkpoint below it (a positive multiple of 256; "
                           f"default {DEFAULT_CHECKPOINT}; 0: off)")
    return parser


def _module(command: str) -> ModuleType:
    if command not in COMMANDS:
        raise CommandError(f"unknown command {command!r}: expected one of {sorted(COMMANDS)}")
    return importlib.import_module(COMMANDS[command])


def _refuse_changed_meanings(ns: argparse.Namespace) -> None:
    if ns.max_kv_size is not None:
        raise CommandError(
            f"--max-kv-size {ns.max_kv_size} is refused: in mlx-lm it sizes a rotating cache "
            "that drops old tokens (and mlx-lm's Muse Glimmer ignores it); muser-kv's caches "
            f"never drop a token: use --max-context {ns.max_kv_size} for a hard limit")
    if getattr(ns, "kv_bits", None) is not None:
        raise CommandError(f"--kv-bits {ns.kv_bits} is refused: muser-kv's caches are not "
                           "quantized (f16 or bf16 planes, --plane-dtype)")
    draft = getattr(ns, "draft_model", None)
    if draft is not None and ns.num_draft_tokens < 1:
        raise CommandError(f"--num-draft-tokens must be >= 1 with --draft-model, got "
                           f"{ns.num_draft_tokens}")
    if ns.kv_store is not None and (ns.session is not None
                                    or getattr(ns, "prompt_cache_file", None) is not None):
        raise CommandError("--kv-store and --session / --prompt-cache-file both give the "
                           "history: pass one of them")
    if ns.session is not None:
        if getattr(ns, "prompt_cache_file", None) is not None:
            raise CommandError("--session and --prompt-cache-file both give the history: "
                               "pass one of them")
        parent = Path(ns.session).absolute().parent
        if not parent.is_dir():
            raise CommandError(f"--session {ns.session}: directory {parent} does not exist")


class Session:
    """The ``--session`` file of one run: read before the model loads, restored
    into the first cache the model builds, written after every complete response.

    Invariant: the file holds the cache as it was at the end of the last
    complete response (chat turn or generation), or, until the first one, what
    it held before; a failed or interrupted response never writes it."""

    def __init__(self, path: str, command: str, model_path: Optional[str]):
        self.path = Path(path)
        self.metadata = {"command": f"muser-kv {command}", "model": str(model_path)}
        self.snapshot: Optional[SessionSnapshot] = None
        self.cache: Optional[List[Any]] = None
        if self.path.exists():
            try:
                self.snapshot = read_session(self.path)
            except SnapshotError as e:
                raise SnapshotError(f"--session {self.path}: {e}") from None
            except OSError as e:
                raise CommandError(f"--session {self.path}: cannot read it ({e})") from None

    @property
    def max_context(self) -> Optional[int]:
        """The context the file was saved with (``None`` for a new session)."""
        return None if self.snapshot is None else self.snapshot.geometry.max_context

    def attach(self, model: Any) -> None:
        """Track every cache ``model.make_cache()`` builds (the newest is the one
        saved); restore the file into one now, so a refusal comes before any
        output, and hand that one out first."""
        build = model.make_cache
        pending: List[List[Any]] = []
        if self.snapshot is not None:
            cache = build()
            try:
                restore_into(cache, self.snapshot)
            except SnapshotError as e:
                raise SnapshotError(f"--session {self.path}: {e}") from None
            pending.append(cache)
            self.snapshot = None

        def make_cache() -> List[Any]:
            self.cache = pending.pop() if pending else build()
            return self.cache

        model.make_cache = make_cache

    def save(self, cache: Optional[List[Any]], mid_line: bool = False) -> None:
        """Write ``cache`` (default: the newest built) and say so on stderr, on a
        line of its own: ``mid_line`` when the streamed text left its line open
        (mlx-lm ends it only after the stream, on stdout, which a terminal
        shows on the same screen)."""
        cache = self.cache if cache is None else cache
        if cache is None:
            raise CommandError(f"--session {self.path}: no cache was built to save")
        try:
            header = save_session(self.path, cache, metadata=self.metadata)
        except OSError as e:
            raise CommandError(f"--session {self.path}: cannot save it ({e}); the file is as "
                               "it was") from None
        print(f"{chr(10) if mid_line else ''}muser-kv: session saved to {self.path} "
              f"({header.position} tokens)", file=sys.stderr, flush=True)


class Loader:
    """mlx-lm's ``load``, then ``install`` on what it loaded: the first model is
    the model (one muser-kv serves, or refused), any later one a draft model."""

    def __init__(self, load: Callable[..., Any], ns: argparse.Namespace,
                 session: Optional[Session]):
        self._load = load
        self._session = session
        draft = getattr(ns, "draft_model", None)
        self._settings = dict(retain=ns.retain, plane_dtype=ns.plane_dtype,
                              num_draft_tokens=ns.num_draft_tokens if draft else None)
        self._max_context = ns.max_context
        self._models = 0

    def __call__(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        loaded = self._load(path, *args, **kwargs)
        model = loaded[0]
        first = self._models == 0
        self._models += 1
        max_context = self._max_context
        if first and max_context is None and self._session is not None:
            max_context = self._session.max_context
        try:
            install(model, max_context=context_for(model, path, max_context), **self._settings)
        except UnsupportedModel as e:
            if first:
                raise UnsupportedModel(f"{path} is not a model muser-kv serves: {e}") from None
            print(f"muser-kv: draft model {path} keeps mlx-lm's caches (not a model muser-kv serves: {e})",
                  file=sys.stderr, flush=True)
            return loaded
        except ValueError as e:  # a setting install refuses (retain=0 with drafts, ...)
            raise CommandError(f"{path}: {e}") from None
        if first and self._session is not None:
            self._session.attach(model)
        return loaded


def _saving(stream_generate: Callable[..., Iterator[Any]],
            session: Session) -> Callable[..., Iterator[Any]]:
    def stream_and_save(*args: Any, **kwargs: Any) -> Iterator[Any]:
        mid_line = False  # mlx-lm's generate and chat print each response's text as it comes
        for response in stream_generate(*args, **kwargs):
            if response.text:
                mid_line = not response.text.endswith("\n")
            yield response
        session.save(kwargs.get("prompt_cache"), mid_line)
    stream_and_save.__doc__ = stream_generate.__doc__
    return stream_and_save


class StoredPrompts:
    """``--kv-store``: ``stream_generate`` over a ``KVStore``. A list the store
    rebuilt, or one whose every token went through here, is known token for
    token (``known``); a list of unknown contents (restored by mlx-lm from
    elsewhere) is passed through untouched. With logits processors (which see
    the prompt's tokens) the prompt is handed to mlx-lm whole, as it is when
    nothing is reused, and only the finished answer is put."""

    def __init__(self, location: str, store_bytes: Optional[int], checkpoint: int = 0):
        self.store = KVStore(location, store_bytes=store_bytes, write_behind=False)
        self.checkpoint = checkpoint
        self.known: Dict[int, List[int]] = {}

    def wrap(self, stream_generate: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def stream(model: Any, tokenizer: Any, prompt: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            cache: List[Any] = kwargs.get("prompt_cache") or []
            if (not cache and kwargs.get("prompt_cache") is None and not args
                    and kwargs.get("draft_model") is None):  # mlx-lm would build it: build it here
                cache = model.make_cache()
                kwargs["prompt_cache"] = cache
            plain = (bool(cache) and all(isinstance(c, MuseKVCache) for c in cache) and not args
                     and kwargs.get("draft_model") is None
                     and kwargs.get("input_embeddings") is None)
            history = self.known.get(id(cache), []) if plain else []
            if not plain or {c.offset for c in cache} != {len(history)}:
                yield from stream_generate(model, tokenizer, prompt, *args, **kwargs)
                return
            tokens = history + _token_ids(tokenizer, prompt)
            n = len(history)
            if n == 0:
                n, _ = self.store.longest_prefix(tokens, model, into=cache)
                if n:
                    print(f"muser-kv: {n} of the prompt's {len(tokens)} tokens rebuilt from "
                          "the KV store", file=sys.stderr, flush=True)
            rest = tokens[n:]
            if len(rest) > 1 and not kwargs.get("logits_processors"):
                step = kwargs.get("prefill_step_size", 2048)
                for lo, hi in prefill_pieces(n, len(tokens) - 1, self.checkpoint):
                    _prefill(model, cache, tokens[lo:hi], step)
                    self.store.put(tokens[:hi], cache, model)  # a checkpoint, or the prompt
                rest = rest[-1:]
            made: List[int] = []
            for response in stream_generate(model, tokenizer, rest, **kwargs):
                made.append(int(response.token))
                yield response
            known = (tokens + made)[:cache[0].offset]
            self.known[id(cache)] = known
            self.store.put(known, cache, model)
        stream.__doc__ = stream_generate.__doc__
        return stream


def _token_ids(tokenizer: Any, prompt: Any) -> List[int]:
    """The ids ``stream_generate`` makes of ``prompt`` (mlx-lm 0.32.2's rule)."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    return [int(t) for t in prompt]


def _prefill(model: Any, cache: List[Any], tokens: List[int], step: int) -> None:
    """``tokens`` through ``model`` in ``step``-token chunks, as ``generate_step``
    prefills, on its stream."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        for at in range(0, len(tokens), step):
            model(mx.array(tokens[at:at + step])[None], cache=cache)
            mx.eval([c.state for c in cache])
            mx.clear_cache()


def _one_process(*args: Any, **kwargs: Any) -> Any:
    raise CommandError("muser-kv chat runs in one process: a sharded model's KV heads per "
                       "rank are not the geometry its args describe")


@contextmanager
def _swapped(module: ModuleType, **attributes: Any) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in attributes}
    argv = sys.argv
    try:
        for name, value in attributes.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        sys.argv = argv


def run(command: str, argv: Sequence[str]) -> int:
    """Run ``muser-kv <command> argv`` (``generate`` or ``chat``): mlx-lm's
    ``main()`` on muser-kv caches. Returns the exit status; refusals raise
    (``CommandError``, ``UnsupportedModel``, ``SnapshotError``,
    ``ContextOverflow``); ``main`` turns them into one line and status 1."""
    module = _module(command)
    argv = list(argv)
    parser = build_parser(command)
    ns = parser.parse_args(argv)  # --help and bad flags exit here, as in mlx-lm
    _refuse_changed_meanings(ns)
    session = Session(ns.session, command, ns.model) if ns.session is not None else None
    swaps: Dict[str, Any] = dict(setup_arg_parser=lambda: parser,
                                 load=Loader(module.load, ns, session))
    if session is not None:
        swaps["stream_generate"] = _saving(module.stream_generate, session)
    stored = (StoredPrompts(ns.kv_store, ns.kv_store_bytes, ns.kv_store_checkpoint)
              if ns.kv_store is not None else None)
    if stored is not None:
        swaps["stream_generate"] = stored.wrap(module.stream_generate)
    if hasattr(module, "sharded_load"):
        swaps["sharded_load"] = _one_process
    try:
        with _swapped(module, **swaps):
            sys.argv = [parser.prog, *argv]
            module.main()
    finally:
        if stored is not None:
            stored.store.close()
    return 0


def main(command: str, argv: Sequence[str]) -> int:
    """``run`` with its refusals printed as one line on stderr (exit status 1)."""
    try:
        return run(command, argv)
    except ContextOverflow as e:
        print(f"muser-kv {command}: {e}: the cache holds --max-context tokens and never drops "
              "one; pass a larger --max-context (at most the model's max_position_embeddings)"
              "; a --session file keeps the last complete response", file=sys.stderr)
        return 1
    except (CommandError, UnsupportedModel, SnapshotError) as e:
        print(f"muser-kv {command}: {e}", file=sys.stderr)
        return 1
