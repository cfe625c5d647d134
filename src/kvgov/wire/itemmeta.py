"""The item metadata kvgov stores with a KV entry, and its mapping to LMCache's ``lm://`` ints.

An engine may attach a small object to each put item: LMCache's ``fmt`` (a ``MemoryFormat``
value), ``dtype`` (a torch dtype name), ``shape`` and ``location``, plus a few scalar fields of
its own. It comes back with every hit and the engine allocates its destination from it, so a
stored value it cannot read (an odd ``fmt``, a dtype name torch lacks, a shape of 10^12) would
break every later get of the entry. :func:`check_item_meta` is the one gate, at PUT, on both
listeners: it returns the canonical form kept in the envelope or raises
:class:`~kvgov.errors.ItemMetaError` (the item is refused as ``bad_item_meta``).

Rules (LMCache 0.5.6, ``lmcache/v1/protocol.py`` and ``memory_management.py``):

- ``fmt``: an int 0..8 (``MemoryFormat``: UNDEFINED .. HS_TD).
- ``dtype``: a name of :data:`DTYPE_CODES` (``half``/``float``/``double`` are stored as
  ``float16``/``float32``/``float64``) or null.
- ``shape``: 1..4 ints, each 0..2^31-1 (``lm://`` carries four; zeros pad).
- ``location``: an int 0..2 (none, LocalCPUBackend, LocalDiskBackend).
- other fields: names ``[a-z][a-z0-9_]{0,31}``, values null, bool, int (64-bit) or a printable
  string of at most 64 characters.
- the whole object, as canonical JSON, at most :data:`MAX_ITEM_META_BYTES` bytes.

Stdlib only (the engine imports :mod:`kvgov.wire`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from kvgov.errors import ItemMetaError

#: canonical JSON of one item's metadata is at most this long
MAX_ITEM_META_BYTES = 256
#: LMCache 0.5.6 ``MemoryFormat`` values: UNDEFINED, KV_2LTD, KV_T2D, KV_2TD, BINARY,
#: BINARY_BUFFER, KV_MLA_FMT, EC_TD, HS_TD
FMT_VALUES = range(9)
#: LMCache ``lm://`` dtype ints by torch dtype name (``DTYPE_TO_INT``; 0 is "no dtype")
DTYPE_CODES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 3,
    "float32": 4,
    "float64": 5,
    "uint8": 6,
    "float8_e4m3fn": 7,
    "float8_e5m2": 8,
}
#: ... and back (``INT_TO_DTYPE``: 1 is ``torch.half``, the same dtype as 2)
DTYPE_NAMES: dict[int, str | None] = {0: None, 1: "float16"} | {
    code: name for name, code in DTYPE_CODES.items()
}
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
#: ``lm://`` location ints: none, LocalCPUBackend, LocalDiskBackend
LOCATION_VALUES = range(3)
MAX_SHAPE_DIMS = 4
MAX_DIM = (1 << 31) - 1
_EXTRA_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_MAX_EXTRA_STR = 64
_INT64 = 1 << 63


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _fmt(value: object) -> int:
    if not _is_int(value) or value not in FMT_VALUES:
        raise ItemMetaError(
            f"fmt must be an int {FMT_VALUES.start}..{FMT_VALUES.stop - 1} (LMCache MemoryFormat)"
        )
    return int(value)


def _dtype(value: object) -> str | None:
    if value is None:
        return None
    name = _DTYPE_ALIASES.get(value, value) if isinstance(value, str) else None
    if name not in DTYPE_CODES:
        raise ItemMetaError(f"dtype must be one of {', '.join(DTYPE_CODES)} or null")
    return name


def _shape(value: object) -> list[int]:
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str | bytes)
        or not 1 <= len(value) <= MAX_SHAPE_DIMS
        or not all(_is_int(d) and 0 <= d <= MAX_DIM for d in value)
    ):
        raise ItemMetaError(f"shape must be a list of 1..{MAX_SHAPE_DIMS} ints, each 0..{MAX_DIM}")
    return [int(d) for d in value]


def _location(value: object) -> int:
    if not _is_int(value) or value not in LOCATION_VALUES:
        raise ItemMetaError(f"location must be an int 0..{LOCATION_VALUES.stop - 1}")
    return int(value)


def _extra(name: object, value: object) -> bool | int | str | None:
    if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name):
        raise ItemMetaError("metadata field names must match [a-z][a-z0-9_]{0,31}")
    if value is None or isinstance(value, bool):
        return value
    if _is_int(value) and -_INT64 <= value < _INT64:
        return int(value)
    if isinstance(value, str) and len(value) <= _MAX_EXTRA_STR and value.isprintable():
        return value
    raise ItemMetaError(
        f"metadata field {name!r} must be null, a bool, a 64-bit int or a printable string of"
        f" at most {_MAX_EXTRA_STR} characters"
    )


_CHECKS = {"fmt": _fmt, "dtype": _dtype, "shape": _shape, "location": _location}


def check_item_meta(meta: object) -> dict[str, Any]:
    """The canonical form of one item's metadata, or :class:`ItemMetaError` saying why not."""
    if meta is None or (type(meta) is dict and not meta):  # the common "none" (no JSON)
        return {}
    if not isinstance(meta, Mapping):
        raise ItemMetaError("item metadata must be an object")
    out: dict[str, Any] = {}
    for name, value in meta.items():
        check = _CHECKS.get(name)
        out[name] = check(value) if check is not None else _extra(name, value)
    if len(canonical_json(out)) > MAX_ITEM_META_BYTES:
        raise ItemMetaError(f"item metadata is longer than {MAX_ITEM_META_BYTES} bytes as JSON")
    return out


def canonical_json(meta: Mapping[str, Any]) -> bytes:
    """The bytes an item's metadata is stored (and authenticated) as."""
    return json.dumps(meta, separators=(",", ":"), sort_keys=True, ensure_ascii=True).encode()


def from_lm(fmt: int, dtype: int, location: int, shape: Sequence[int]) -> dict[str, Any]:
    """The metadata of an ``lm://`` PUT, its dtype int mapped to the name (an int LMCache does
    not define is kept as is, for :func:`check_item_meta` to refuse)."""
    name = DTYPE_NAMES.get(dtype, dtype)
    return {"fmt": fmt, "dtype": name, "location": location, "shape": list(shape)}


def to_lm(meta: Mapping[str, Any]) -> tuple[int, int, list[int], int]:
    """``(fmt, dtype int, shape padded to four, location)`` for an ``lm://`` GET reply; what
    is absent (an entry stored over the kvgov wire without it) is 0. Never raises: the stored
    metadata was checked at PUT."""
    fmt = meta.get("fmt")
    dtype = meta.get("dtype")
    location = meta.get("location")
    shape = meta.get("shape")
    dims = (
        [d if _is_int(d) else 0 for d in shape[:MAX_SHAPE_DIMS]] if isinstance(shape, list) else []
    )
    return (
        fmt if isinstance(fmt, int) and fmt in FMT_VALUES else 0,
        DTYPE_CODES.get(dtype, 0) if isinstance(dtype, str) else 0,
        dims + [0] * (MAX_SHAPE_DIMS - len(dims)),
        location if isinstance(location, int) and location in LOCATION_VALUES else 0,
    )
