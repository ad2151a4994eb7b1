"""Buffers with guard pages, for running kernels on the CPU.

An ``Arena`` lays out the buffers of one kernel run in one mapping, each
between PROT_NONE guards at least as large as the buffer (and at least 64 KiB).
Data sits flush against the guard above it (``Placement.END``: one element
past the end faults) or the guard below (``Placement.START``: one element
before the start faults); the rest of its pages holds a canary. The run itself
(``runtime.cpp``: muser_kv_prepare / muser_kv_finish, given ``Arena.table``)
fills the outputs, lays the canaries, makes inputs read-only -- a write
through an input pointer faults -- and afterwards checks the canaries. Running
once with each placement catches every access outside a buffer, in either
direction, up to the guard's size.

Arenas are reused for the next run with the same buffer sizes (``acquire``):
mapping fresh pages for every run would cost more than the runs.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

PAGE = mmap.PAGESIZE
MIN_GUARD = 64 * 1024
PROT_NONE = 0
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
POOL_SIZE = 64

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class Placement(enum.Enum):
    END = "end"  # data ends where the guard above it begins
    START = "start"  # data starts where the guard below it ends


def _round(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _protect(address: int, size: int, prot: int) -> None:
    if _libc.mprotect(address, size, prot) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")


class BufferRecord(ctypes.Structure):
    """runtime.cpp's muser_kv_buffer."""

    _fields_ = [("pages", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("address", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("output", ctypes.c_int32), ("unused", ctypes.c_int32)]


@dataclass
class Buffer:
    """One guarded buffer: ``nbytes`` of data at ``address`` inside ``pages``."""

    name: str
    kind: str  # "input", "constant" or "output"
    nbytes: int
    pages: int  # first data page
    size: int  # bytes of data pages
    address: int  # first data byte

    def array(self, dtype=np.uint8) -> np.ndarray:
        """The data as a numpy view (writable while the buffer is)."""
        raw = (ctypes.c_char * max(self.nbytes, 1)).from_address(self.address)
        return np.frombuffer(raw, dtype=np.uint8, count=self.nbytes).view(dtype)

    def describe(self, address: int, guard: int) -> Optional[str]:
        """Where ``address`` lies relative to this buffer, if within a guard of it."""
        if not self.pages - guard <= address < self.pages + self.size + guard:
            return None
        offset = address - self.address
        if 0 <= offset < self.nbytes:
            return f"byte {offset} of {self.kind} `{self.name}` ({self.nbytes} B)"
        where = (f"{-offset} B before" if offset < 0
                 else f"{offset - self.nbytes + 1} B past the end of")
        return f"{where} {self.kind} `{self.name}` ({self.nbytes} B)"


class Arena:
    """The guarded buffers of one run layout: ``specs`` is [(name, kind, nbytes)].
    Between runs every data page is writable (the runtime restores that)."""

    def __init__(self, specs: Sequence[Tuple[str, str, int]], placement: Placement):
        self.placement = placement
        sizes = [_round(max(n, 1)) for _, _, n in specs]
        self.guard = max([MIN_GUARD] + sizes)
        self.size = self.guard + sum(s + self.guard for s in sizes)
        base = _libc.mmap(None, self.size, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {self.size} B failed")
        self.base = base
        self.buffers: List[Buffer] = []
        pages = base + self.guard
        for (name, kind, nbytes), size in zip(specs, sizes):
            address = pages + size - nbytes if placement is Placement.END else pages
            self.buffers.append(Buffer(name, kind, nbytes, pages, size, address))
            _protect(pages, size, PROT_RW)
            pages += size + self.guard
        self.table = (BufferRecord * max(len(specs), 1))(*[
            BufferRecord(b.pages, b.size, b.address, b.nbytes, int(b.kind == "output"), 0)
            for b in self.buffers])

    def inside(self, address: int):
        """(name, byte offset) when ``address`` is inside a non-output buffer's data."""
        for b in self.buffers:
            if b.kind != "output" and 0 <= address - b.address < b.nbytes:
                return b.name, address - b.address
        return None

    def describe(self, address: int) -> str:
        for b in self.buffers:
            where = b.describe(address, self.guard)
            if where:
                return where
        return f"address {address:#x}, in no buffer of this kernel"

    def close(self) -> None:
        if self.base:
            _libc.munmap(self.base, self.size)
            self.base = 0


_POOL: "OrderedDict[tuple, Arena]" = OrderedDict()


def acquire(specs: Sequence[Tuple[str, str, int]], placement: Placement) -> Arena:
    """An arena for this layout (the one of an earlier run when there is one)."""
    key = (placement, tuple(specs))
    arena = _POOL.pop(key, None)
    if arena is None:
        arena = Arena(specs, placement)
        while len(_POOL) >= POOL_SIZE:
            _POOL.popitem(last=False)[1].close()
    _POOL[key] = arena
    return arena
