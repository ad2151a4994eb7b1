"""mlx-lm's prompt-cache files (``save_prompt_cache`` / ``load_prompt_cache``)
with muser-kv caches in them.

mlx-lm writes each cache's ``type(c).__name__`` and flattened ``state`` into
the file, and at load calls ``from_state(state)`` on the class of that name in
its own ``mlx_lm.models.cache`` module. So muser-kv's classes carry the package
in that name -- ``muser_kv.SlidingKVCache``, ``muser_kv.GlobalKVCache`` --, and
``register()`` puts them into that module under those names: when ``muser_kv``
is imported after mlx-lm, else when muser-kv first builds a cache list
(``make_cache_for``), installs a model or runs a command, or when the caller
asks (``muser_kv.register_prompt_files()``). Importing ``muser_kv`` never
imports mlx-lm itself: mlx-lm's package imports transformers, which takes
seconds (13 s on a CUDA machine with torch), and muser-kv's kernels, files and
selftest need none of it. A file of muser-kv caches loaded before any of these
fails inside mlx-lm with ``KeyError: 'muser_kv.SlidingKVCache'``, which names
what is missing; the names cannot collide with mlx-lm's own classes (mlx-lm has
a ``BatchKVCache`` too), and files of mlx-lm's own caches load with mlx-lm's
classes as before.

What such a file holds is exactly what ``state`` holds: the planes in their
physical layout, the ring, the retained rows. mlx-lm's format has no checksum
and no model identity; ``from_state`` checks every shape and position, but not
that the file belongs to this model. Session files (``save_session``) are the
validated format: checksummed, fingerprinted, atomic.
"""

from __future__ import annotations

import sys
from typing import Dict

from muser_kv.caches.batch import BatchKVCache
from muser_kv.caches.growing import GlobalKVCache
from muser_kv.caches.sliding import SlidingKVCache

#: The name mlx-lm writes into a prompt-cache file for each class, and looks up.
FILE_NAMES: Dict[type, str] = {
    SlidingKVCache: "muser_kv.SlidingKVCache",
    GlobalKVCache: "muser_kv.GlobalKVCache",
    BatchKVCache: "muser_kv.BatchKVCache",
}



_registered = False


def name_classes() -> None:
    """Give each class the name mlx-lm's ``save_prompt_cache`` writes
    (``type(c).__name__``); ``muser_kv/__init__.py`` calls it once."""
    for cls, name in FILE_NAMES.items():
        cls.__name__ = name


def register() -> bool:
    """Make mlx-lm's ``load_prompt_cache`` find muser-kv's classes (once;
    importing mlx-lm if it is not yet); returns whether mlx-lm is installed
    (without it there is no loader)."""
    global _registered
    if _registered:
        return True
    name_classes()
    try:
        import mlx_lm.models.cache as lm_cache
    except ImportError:
        return False
    for cls, name in FILE_NAMES.items():
        setattr(lm_cache, name, cls)
    _registered = True
    return True


def register_if_loaded() -> None:
    """``register()`` when mlx-lm's cache module is already imported (free then)."""
    if "mlx_lm.models.cache" in sys.modules:
        register()
