"""The one module that names every mlx-lm internal ``muser-kv serve`` relies on
(``muser_kv.serving.server.mlx_lm_server``): each named member is there as
serve uses it, a change to one is reported by its name, no other serving module
reads an mlx-lm private past it, and every mlx-lm member serve overrides is named
with its parameters."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import mlx_lm.server
import pytest

import muser_kv
from muser_kv.serving.server import mlx_lm_server as mlx
from muser_kv.serving.server import serve
from muser_kv.serving.server.prompt_cache import ExactPromptCache, ExactPromptTrie
from muser_kv.serving.server.scheduler import ServeBatchGenerator

SERVING = Path(muser_kv.__file__).parent / "serving"


@pytest.mark.parametrize("member", mlx.REQUIRED, ids=lambda m: m.qualname)
def test_every_named_member_is_there_as_serve_uses_it(member):
    assert member.problem() is None


def test_the_installed_mlx_lm_has_every_member():
    assert mlx.problems() == []
    mlx.require()


def test_a_member_gone_is_named(monkeypatch):
    monkeypatch.delattr(mlx_lm.server.ModelProvider, "_load")
    monkeypatch.delattr(mlx_lm.server, "scan_cache_dir")
    gone = {"mlx_lm.server.ModelProvider._load is gone", "mlx_lm.server.scan_cache_dir is gone"}
    assert set(mlx.problems()) == gone
    with pytest.raises(ImportError) as refused:
        mlx.require()
    assert all(line in str(refused.value) for line in gone)


def test_a_callable_whose_parameters_changed_is_named(monkeypatch):
    def _tokenize(self, request, tokenizer, args):  # the first two swapped
        raise AssertionError("not called")

    monkeypatch.setattr(mlx_lm.server.ResponseGenerator, "_tokenize", _tokenize)
    assert mlx.problems() == [
        "mlx_lm.server.ResponseGenerator._tokenize takes (self, request, tokenizer, args), "
        "serve expects (self, tokenizer, request, args)"]
    monkeypatch.setattr(mlx_lm.server, "scan_cache_dir", "not a function")
    assert "mlx_lm.server.scan_cache_dir is no longer callable" in mlx.problems()


def test_an_instance_attribute_no_longer_set_is_named(monkeypatch):
    original = mlx_lm.server.ModelProvider.__init__

    def __init__(self, cli_args):
        self.cli_args = cli_args
        self.model_paths = {"default_model": cli_args.model}  # a renamed map

    monkeypatch.setattr(mlx_lm.server.ModelProvider, "__init__", __init__)
    assert mlx.problems() == [
        f"mlx_lm.server.ModelProvider.{name} is no longer set by ModelProvider.__init__"
        for name in ("_model_map", "_adapter_map", "_draft_model_map")]
    monkeypatch.setattr(mlx_lm.server.ModelProvider, "__init__", original)
    assert mlx.problems() == []


def _names(path: Path) -> set:
    """The identifiers ``path``'s code uses (strings and comments left out)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_other_serving_module_reads_an_mlx_lm_private():
    """The privates serve reads (not those it overrides) are read in the adapter only."""
    overridden = {name for cls in (serve.MuseModelProvider, serve.MuseResponseGenerator,
                                   serve.MuseAPIHandler, ExactPromptCache, ExactPromptTrie,
                                   ServeBatchGenerator)
                  for name in vars(cls)}
    read = {m.name for m in mlx.REQUIRED if _private(m.name)} - overridden
    assert {"_model_map", "_should_stop", "_download", "_get_classes", "_trie"} <= read
    adapter = Path(mlx.__file__)
    for path in sorted(SERVING.rglob("*.py")):
        if path != adapter:
            assert not read & _names(path), f"{path.relative_to(SERVING)} reads {read & _names(path)}"


@pytest.mark.parametrize("ours", [serve.MuseModelProvider, serve.MuseResponseGenerator,
                                  serve.MuseAPIHandler, ExactPromptCache, ExactPromptTrie,
                                  ServeBatchGenerator],
                         ids=lambda c: c.__name__)
def test_every_mlx_lm_member_serve_overrides_is_named_with_its_parameters(ours):
    """An override (``__init__`` and public methods too) calls mlx-lm's through
    ``super()`` with its parameters: a change to them must fail at import."""
    base = ours.__mro__[1]
    named = {(m.owner, m.name): m for m in mlx.REQUIRED}
    overrides = [n for n in vars(ours) if (not n.startswith("__") or n == "__init__")
                 and any(n in vars(c) for c in base.__mro__ if c is not object)]
    assert overrides
    for name in overrides:
        owner = next(c for c in base.__mro__ if name in vars(c))
        member = named.get((owner, name))
        assert member is not None, f"{ours.__name__} overrides {owner.__name__}.{name}, not named"
        if callable(vars(owner)[name]):
            assert member.params is not None, f"{owner.__name__}.{name}: its parameters unchecked"


def test_substituted_replaces_exactly_the_named_globals_and_puts_them_back():
    before = {name: getattr(mlx_lm.server, name) for name in mlx.SUBSTITUTED}
    stand_ins = {name: object() for name in mlx.SUBSTITUTED}
    with mlx.substituted(stand_ins):
        assert all(getattr(mlx_lm.server, n) is v for n, v in stand_ins.items())
    assert all(getattr(mlx_lm.server, n) is v for n, v in before.items())
    with pytest.raises(ValueError, match="replaces exactly"):
        with mlx.substituted({"argparse": object()}):
            pass  # pragma: no cover
    assert all(getattr(mlx_lm.server, n) is v for n, v in before.items())
    with serve.substituted([]):  # serve's replacements: every named global, none other
        assert mlx_lm.server.ModelProvider is serve.MuseModelProvider
        assert mlx_lm.server.LRUPromptCache is ExactPromptCache
        assert mlx_lm.server.BatchGenerator is not before["BatchGenerator"]
    assert all(getattr(mlx_lm.server, n) is v for n, v in before.items())
