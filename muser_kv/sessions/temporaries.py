"""Temporaries of atomic saves: a save writes ``.NAME.PID-RANDOM.tmp`` beside
its target and renames it; one killed outright leaves it behind, and the next
save or load of the same target removes it (only that target's, of no live
process, never another file)."""

from __future__ import annotations

import os
import re
import stat
import threading
from pathlib import Path
from typing import List

from muser_kv.sessions.format import PathLike

#: Temporaries this process is writing now (never stale, whatever their name says).
IN_FLIGHT: set = set()
IN_FLIGHT_LOCK = threading.Lock()


def _temporary_pattern(path: Path) -> "re.Pattern[str]":
    """Names of ``path``'s temporaries: ``.NAME.<pid>-<16 hex>.tmp`` (and the
    ``.NAME.<16 hex>.tmp`` earlier versions wrote, which name no process)."""
    return re.compile(rf"\.{re.escape(path.name)}\.(?:(\d+)-)?[0-9a-f]{{16}}\.tmp")


def alive(pid: int) -> bool:
    """Whether process ``pid`` may still be running (this one is; one that
    cannot be asked counts as running, so its files are kept)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError, OSError):
        return True  # exists (someone else's), or cannot tell: keep its file
    return True



def tidy_temporaries(path: PathLike) -> List[Path]:
    """Remove the stale temporaries of the session file ``path`` -- those a save
    that was killed outright left behind -- and return them. A temporary is
    stale when the process its name records is gone (or, for this process, when
    no save of this process is writing it). Only regular files named as this
    target's temporaries are touched, never any other file; failures to list
    or remove are ignored (tidying is best effort, never a reason to fail)."""
    target = Path(path)
    directory = target.parent
    pattern = _temporary_pattern(target)
    removed: List[Path] = []
    try:
        names = os.listdir(directory if str(directory) else ".")
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        tmp = directory / name
        with IN_FLIGHT_LOCK:
            if str(tmp) in IN_FLIGHT:
                continue
        pid = m.group(1)
        if pid is not None and int(pid) != os.getpid() and alive(int(pid)):
            continue
        try:
            if not stat.S_ISREG(os.lstat(tmp).st_mode):
                continue
            os.unlink(tmp)
            removed.append(tmp)
        except OSError:
            pass
    return removed
