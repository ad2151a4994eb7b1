"""mlx-lm's prompt-cache files (``save_prompt_cache`` / ``load_prompt_cache``)
with muser-kv caches in them.

mlx-lm writes each cache's ``type(c).__name__`` and flattened ``state`` into
the file, and at load calls ``from_state(state)`` on the class of that name in
its own ``mlx_lm.models.cache`` module. So muser-kv's classes carry the package
in that name -- ``muser_kv.SlidingKVCache``, ``muser_kv.GlobalKVCache`` --, and
``register()`` (run when ``muser_kv`` is imported, if mlx-lm is installed) puts
them into that module under those names. A file of muser-kv caches loaded in a
process that never imported muser-kv fails inside mlx-lm with
``KeyError: 'muser_kv.SlidingKVCache'``, which names what is missing; the names
cannot collide with mlx-lm's own classes (mlx-lm has a ``BatchKVCache`` too),
and files of mlx-lm's own caches load with mlx-lm's classes as before.

What such a file holds is exactly what ``state`` holds: the planes in their
physical layout, the ring, the retained rows. mlx-lm's format has no checksum
and no model identity; ``from_state`` checks every shape and position, but not
that the file belongs to this model. Session files (``save_session``) are the
validated format: checksummed, fingerprinted, atomic.
"""

from __future__ import annotations

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



def register() -> bool:
    """Name muser-kv's classes for prompt-cache files and make mlx-lm's
    ``load_prompt_cache`` find them (``muser_kv/__init__.py`` calls it once);
    returns whether mlx-lm is installed (without it there is no loader)."""
    for cls, name in FILE_NAMES.items():
        cls.__name__ = name  # what ``type(c).__name__`` gives mlx-lm's save_prompt_cache
    try:
        import mlx_lm.models.cache as lm_cache
    except ImportError:
        return False
    for cls, name in FILE_NAMES.items():
        setattr(lm_cache, name, cls)
    return True
