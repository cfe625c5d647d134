"""Fresh buffers for the memory tier, their pages faulted in without holding the GIL.

A fresh anonymous mapping costs nothing until its pages are touched; the first touch of each
page faults (on these VMs ~0.3 ms of kernel time per MiB when done in one pass, more page by
page). ``mmap.mmap(..., MAP_POPULATE)`` does that pass inside ``mmap()``, which CPython calls
with the GIL held, so every other thread of the sidecar (the crypto pool, the ledger writer)
stops for it: measured here, a thread spinning beside a 512 MiB ``MAP_POPULATE`` got 3% of its
usual turns. :func:`new_buffer` maps without the flag and then asks the kernel to populate the
range with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) through :mod:`ctypes`, which
releases the GIL for the call (98% of the spinner's turns, the same ~160 ms). Where that
advice does not exist it falls back to ``MAP_POPULATE``, and where that does not exist to a
``bytearray``.

:func:`map_buffer` and :func:`populate` are the two halves, for a caller that hands the buffer
out at once and has another thread fault its pages in meanwhile (the memory tier's
reservations). Faulting a page in twice is harmless: whichever thread touches it first does.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
from functools import cache

#: Linux's ``MADV_POPULATE_WRITE`` (``<asm-generic/mman-common.h>``): fault the range in,
#: writable, as a write to each page would
MADV_POPULATE_WRITE = 23

#: a buffer the memory tier pools: writable, exactly sized
Pooled = bytearray | mmap.mmap


@cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise`` (a foreign call: ctypes releases the GIL around it), or None. Looked
    up in the running program (``dlopen(NULL)``), which links libc: ``find_library`` would
    start a subprocess."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class _Kernel:
    #: whether this kernel knows ``MADV_POPULATE_WRITE`` (None: not asked yet)
    populate_write: bool | None = None


def populate(buf: mmap.mmap) -> bool:
    """Fault every page of ``buf`` in, without the GIL; False where the kernel cannot (the
    caller then maps another way)."""
    if _Kernel.populate_write is False:
        return False
    fn = _madvise()
    if fn is None:
        _Kernel.populate_write = False
        return False
    anchor = ctypes.c_char.from_buffer(buf)  # a buffer export, released below
    try:
        ok: bool = fn(ctypes.addressof(anchor), len(buf), MADV_POPULATE_WRITE) == 0
        err = ctypes.get_errno()
    finally:
        del anchor
    if _Kernel.populate_write is None:
        _Kernel.populate_write = ok or err != errno.EINVAL
    return ok


def map_buffer(size: int) -> Pooled:
    """A zeroed, writable buffer of exactly ``size`` bytes, its pages not faulted in yet (an
    anonymous mapping; a ``bytearray`` where there is none)."""
    if size and hasattr(mmap, "MAP_ANONYMOUS"):
        try:
            return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:  # no room for a mapping: let bytearray raise MemoryError if need be
            pass
    return bytearray(size)


def new_buffer(size: int) -> Pooled:
    """A zeroed, writable buffer of exactly ``size`` bytes, every page already faulted in."""
    buf = map_buffer(size)
    if not isinstance(buf, mmap.mmap) or populate(buf):
        return buf
    buf.close()
    try:
        return mmap.mmap(
            -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        )
    except OSError:
        return bytearray(size)
