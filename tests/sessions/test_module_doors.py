"""The sessions modules (outside ``store/``) meet through public names only: none
imports a ``_``-prefixed name from another ``muser_kv`` module, nor reaches one
through a module it imported. A part two modules share is a public module or a
public name of the module that owns it (``docs/architecture.md``)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Dict, List

import muser_kv.sessions

SESSIONS = Path(muser_kv.sessions.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(dotted: str) -> bool:
    try:
        importlib.import_module(dotted)
    except ImportError:
        return False
    return True


def reaches(path: Path) -> List[str]:
    """Every private name of another ``muser_kv`` module that ``path`` imports or
    reads off a module it imported, as ``line: module.name``."""
    tree = ast.parse(path.read_text(), str(path))
    own = f"muser_kv.sessions.{path.stem}"
    modules: Dict[str, str] = {}  # local name -> a muser_kv module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("muser_kv"):
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if _private(alias.name):
                    found.append(f"{node.lineno}: {dotted}")
                elif _is_module(dotted):
                    modules[alias.asname or alias.name] = dotted
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("muser_kv") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in modules
                and modules[node.value.id] != own):
            found.append(f"{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def test_the_checker_sees_each_kind_of_reach(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("from muser_kv.sessions.format import _hidden, parse_header\n"
                      "from muser_kv.sessions import wire\n"
                      "import muser_kv.sessions.reading as reading\n"
                      "wire._secret(reading._other, wire.link, parse_header)\n")
    assert sorted(reaches(source)) == ["1: muser_kv.sessions.format._hidden",
                                       "4: muser_kv.sessions.reading._other",
                                       "4: muser_kv.sessions.wire._secret"]


def test_no_sessions_module_imports_another_modules_private_names():
    modules = sorted(SESSIONS.glob("*.py"))
    assert len(modules) > 10  # the checker walks the package itself, not an empty folder
    found = {p.name: reaches(p) for p in modules}
    assert {name: hits for name, hits in found.items() if hits} == {}
