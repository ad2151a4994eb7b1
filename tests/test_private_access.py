"""No module reaches into another object's private state.

A class owns its ``_`` members: code outside it asks a public method. This
scans every module of ``muser_kv`` for ``x._name`` where ``x`` is anything but
``self``, ``cls`` or ``super()``. The allowlist names each exception and why:
copies a class builds of itself (the same class on both sides), and the one
frame lookup the list's checks make on purpose. A new reach fails here with
the file, line and expression.
"""

import ast
from pathlib import Path

import muser_kv

ROOT = Path(muser_kv.__file__).parent

#: (module, expression, attribute): a new entry needs a reason beside it
SAME_CLASS = {
    # MuseKVCache._detached / from_state / __deepcopy__: a cache copying or
    # building a cache of its own hierarchy
    ("caches/base.py", "other", "_list"), ("caches/base.py", "other", "_index"),
    ("caches/base.py", "other", "_prev"), ("caches/base.py", "other", "_lead"),
    ("caches/base.py", "other", "_first_of_kind"), ("caches/base.py", "other", "_checkpoints"),
    ("caches/base.py", "c", "_detached"), ("caches/base.py", "cache", "_first_of_kind"),
    ("caches/base.py", "cache", "_adopt_retained"),
    ("caches/base.py", "regime", "_check_state_retained"),
    # SlidingKVCache._detached / bound_to: the copy's retained rows
    ("caches/sliding.py", "other", "_retained"),
    # RetainedRows.copy
    ("caches/speculative.py", "other", "_blocks"), ("caches/speculative.py", "other", "_recent"),
    # BatchKVCache.extend / __deepcopy__: the other batch's pending prompt lengths
    ("caches/batch.py", "other", "_remaining"),
}

#: the list finds the model and the sequence it was handed in mlx-lm's mask
#: helper's caller's frame (cachelist._model_frame), the one place a model
#: hands its caches anything before the first layer writes: kept on purpose
#: (docs/architecture.md, "A decode token's walk")
FRAME_LOOKUP = {("caches/cachelist.py", "sys", "_getframe")}

#: the drained server exits without the interpreter's teardown, which MLX's
#: native threads abort (std::terminate): os._exit is the standard library's
#: documented call for it, not another object's state (serving/server/shutdown.py)
PROCESS_EXIT = {("serving/server/shutdown.py", "os", "_exit")}

#: the one module that reads mlx-lm's private members, each named in its
#: ``REQUIRED`` and checked there (tests/serving/test_mlx_lm_server.py)
MLX_LM_ADAPTER = "serving/server/mlx_lm_server.py"


def reaches():
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__"):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                    and owner.func.id == "super"):
                continue
            yield module, ast.unparse(owner), name, node.lineno


def test_no_module_reaches_into_another_objects_private_members():
    allowed = SAME_CLASS | FRAME_LOOKUP | PROCESS_EXIT
    found = [r for r in reaches() if r[:3] not in allowed and r[0] != MLX_LM_ADAPTER]
    assert not found, "private members reached from outside their object:\n" + "\n".join(
        f"  muser_kv/{m}:{line}: {expr}.{name}" for m, expr, name, line in found)


def test_the_same_class_allowlist_holds_no_stale_entry():
    """An entry whose reach is gone is removed, so the list only shrinks."""
    seen = {r[:3] for r in reaches()}
    assert not (SAME_CLASS | FRAME_LOOKUP | PROCESS_EXIT) - seen
