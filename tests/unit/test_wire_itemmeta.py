"""Item metadata: what kvgov stores with an entry, and how ``lm://`` ints map to it."""

from __future__ import annotations

from typing import Any

import pytest

from kvgov.errors import ItemMetaError
from kvgov.wire.itemmeta import (
    DTYPE_CODES,
    MAX_ITEM_META_BYTES,
    canonical_json,
    check_item_meta,
    from_lm,
    to_lm,
)


def test_lmcache_metadata_is_kept_in_canonical_form() -> None:
    meta = {"shape": [2, 32, 256, 1024], "fmt": 1, "dtype": "half", "location": 0, "h": "a1"}
    out = check_item_meta(meta)
    assert out == {**meta, "dtype": "float16"}
    assert canonical_json(out).startswith(b'{"dtype":"float16","fmt":1,"h":"a1"')
    assert check_item_meta(None) == {} == check_item_meta({})


@pytest.mark.parametrize(
    "meta",
    [
        {"fmt": 9},
        {"fmt": -1},
        {"fmt": 1.0},
        {"fmt": False},
        {"dtype": "int128"},
        {"dtype": 3},
        {"shape": "1,2"},
        {"shape": [1, 2, 3, 4, 5]},
        {"shape": [True]},
        {"shape": [1 << 31]},
        {"location": 3},
        {"x": [1]},
        {"x": "\x00"},
        {"x": "y" * 65},
        {"x": 1 << 63},
        {"_sealed": False},
        {"A": 1},
        {f"k{i}": "v" * 60 for i in range(4)},
        [("fmt", 1)],
    ],
)
def test_odd_metadata_is_refused(meta: Any) -> None:
    with pytest.raises(ItemMetaError):
        check_item_meta(meta)


def test_the_size_cap_counts_canonical_json() -> None:
    fits: dict[str, Any] = {f"a{i}": "x" * 64 for i in range(3)}
    fits["b"] = "y" * (MAX_ITEM_META_BYTES - len(canonical_json({**fits, "b": ""})))
    assert len(canonical_json(fits)) == MAX_ITEM_META_BYTES
    assert check_item_meta(fits) == fits
    with pytest.raises(ItemMetaError):
        check_item_meta({**fits, "b": fits["b"] + "y"})


def test_lm_ints_round_trip_through_names() -> None:
    for name, code in DTYPE_CODES.items():
        meta = check_item_meta(from_lm(1, code, 2, (1, 2, 3, 0)))
        assert meta["dtype"] == name
        assert to_lm(meta) == (1, code, [1, 2, 3, 0], 2)
    assert check_item_meta(from_lm(0, 1, 0, (0, 0, 0, 0)))["dtype"] == "float16"  # torch.half
    assert check_item_meta(from_lm(0, 0, 0, (0, 0, 0, 0)))["dtype"] is None
    with pytest.raises(ItemMetaError):
        check_item_meta(from_lm(0, 42, 0, (0, 0, 0, 0)))


def test_lm_reply_from_anything_stored_never_raises() -> None:
    assert to_lm({}) == (0, 0, [0, 0, 0, 0], 0)
    assert to_lm({"h": "x", "dtype": None}) == (0, 0, [0, 0, 0, 0], 0)
    assert to_lm({"fmt": 99, "dtype": "nope", "shape": "x", "location": 9}) == (
        0,
        0,
        [0, 0, 0, 0],
        0,
    )
    assert to_lm({"shape": [5, 6]}) == (0, 0, [5, 6, 0, 0], 0)
