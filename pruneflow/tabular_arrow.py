"""Tabular columns encoded as column operations on Arrow arrays: no Python loop per value.

What ``tabular.TabularSchema`` fits is applied here to a whole column at once (a record batch of a streamed log,
or a split held in memory): text is trimmed by ``pyarrow.compute``, looked up in a vocabulary with Arrow's hash
table (``pc.index_in``), hashed with a byte-position-wise 64-bit FNV-1a over the column's UTF-8 buffer (each
distinct value once: the column is dictionary-encoded first), numbers are normalised with numpy.

The hash a deployment record names (``hash_buckets``) is reproducible by any serving system:

- an integer value (an integer column) is its own hash: ``id = value mod buckets`` (Python's ``%``: never negative);
  a missing value in an integer column hashes as the text ``""`` (below);
- any other value is taken as text (surrounding whitespace removed; a missing value is ``""``; a float holding a
  whole number is written as that integer, ``7.0`` -> ``"7"``), and ``id = FNV-1a-64(utf8(text)) mod buckets``,
  FNV-1a-64 being ``h = 0xcbf29ce484222325; for byte in text: h = ((h ^ byte) * 0x100000001b3) mod 2**64``.

``tests/test_tabular_stream.py`` holds a reference implementation of exactly this in plain Python, checked against
the vectorised one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

FNV_OFFSET, FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)


def as_arrow(values: Any) -> "pa.Array":
    """A column (numpy array, list, Arrow array or chunked array) as one Arrow array."""
    import pyarrow as pa

    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if isinstance(values, pa.Array):
        return values
    arr = np.asarray(values)
    if arr.dtype.kind == "O":  # None, str, numbers mixed: Arrow infers; text is what a mixture becomes
        try:
            return pa.array(arr, from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return pa.array(["" if v is None else str(v) for v in arr], pa.large_string())
    return pa.array(arr, from_pandas=True)


def is_integer(arr: "pa.Array") -> bool:
    import pyarrow as pa

    return pa.types.is_integer(arr.type) or pa.types.is_boolean(arr.type)


def text(values: Any) -> "pa.Array":
    """A categorical column as trimmed text (large_string, no nulls): integers written in decimal, a missing value
    ``""``, a float holding a whole number written as that integer (``tabular._text``'s rule, as column ops)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = as_arrow(values)
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_boolean(arr.type):
        arr = arr.cast(pa.int64())
    if pa.types.is_floating(arr.type):
        x = arr.to_numpy(zero_copy_only=False).astype(np.float64)
        whole = np.isfinite(x) & (x == np.round(np.nan_to_num(x)))
        as_int = pa.array(np.where(whole, np.nan_to_num(x), 0).astype(np.int64)).cast(pa.large_string())
        out = pc.if_else(pa.array(whole), as_int, arr.cast(pa.large_string()))
        return pc.if_else(pa.array(np.isnan(x)), pa.scalar("", pa.large_string()), out)
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = arr.cast(pa.large_string())
    return pc.fill_null(pc.utf8_trim_whitespace(arr.cast(pa.large_string())), "")


def fnv1a_64(strings: "pa.Array") -> np.ndarray:
    """FNV-1a-64 of every value's UTF-8 bytes (uint64), one numpy operation a byte position, over the column's own
    buffer (numpy's uint64 product wraps modulo 2**64, as FNV asks)."""
    import pyarrow as pa

    arr = strings.cast(pa.large_string()) if not pa.types.is_large_string(strings.type) else strings
    n = len(arr)
    out = np.full(n, FNV_OFFSET, dtype=np.uint64)
    if n == 0:
        return out
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[arr.offset : arr.offset + n + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")  # longest first: the rows still hashing at byte j are a prefix
    starts, lengths = starts[order], lengths[order]
    h = out[order]
    with np.errstate(over="ignore"):
        for j in range(int(lengths[0]) if n else 0):
            live = int(np.searchsorted(-lengths, -j, side="left"))  # rows longer than j
            h[:live] = (h[:live] ^ data[starts[:live] + j].astype(np.uint64)) * FNV_PRIME
    out[order] = h
    return out


def hashed_ids(values: Any, buckets: int) -> np.ndarray:
    """The hashed ids of a column (module docstring): integers modulo ``buckets``, other values by FNV-1a-64 of their
    text, each distinct value hashed once."""
    import pyarrow.compute as pc

    import pyarrow as pa

    arr = as_arrow(values)
    if pa.types.is_integer(arr.type):  # booleans are text "0"/"1", as tabular._text has them
        ids = np.mod(pc.fill_null(arr.cast(pa.int64()), 0).to_numpy(zero_copy_only=False), buckets)
        if arr.null_count:  # a missing value in an integer column: the text "", as everywhere else
            ids[arr.is_null().to_numpy(zero_copy_only=False)] = int(fnv1a_64(pa.array([""]))[0] % np.uint64(buckets))
        return ids
    encoded = pc.dictionary_encode(text(arr))
    distinct = fnv1a_64(encoded.dictionary) % np.uint64(buckets)
    return distinct.astype(np.int64)[encoded.indices.to_numpy(zero_copy_only=False)]


class Lookup:
    """A vocabulary (id ``i + 1`` is ``vocabulary[i]``, 0 outside it) as an Arrow hash table, built once and applied
    to every batch; an integer column is looked up as integers when every entry is a decimal integer."""

    def __init__(self, vocabulary: Sequence[str]):
        import pyarrow as pa

        self.strings = pa.array(list(vocabulary), pa.large_string())
        ints = _integer_entries(vocabulary)
        self.ints = pa.array(ints, pa.int64()) if ints is not None else None

    def __call__(self, values: Any) -> np.ndarray:
        import pyarrow as pa
        import pyarrow.compute as pc

        arr = as_arrow(values)
        if self.ints is not None and is_integer(arr):
            found = pc.index_in(arr.cast(pa.int64()), value_set=self.ints)
        else:
            found = pc.index_in(text(arr), value_set=self.strings)
        return pc.fill_null(found, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1


def _integer_entries(vocabulary: Sequence[str]) -> list[int] | None:
    """The vocabulary as integers when each entry is an integer's canonical decimal text (``"7"``, ``"-3"``), else
    None (``"07"`` is another value than 7 and must stay text)."""
    if not vocabulary:
        return None
    try:
        ints = [int(v) for v in vocabulary]
    except ValueError:
        return None
    return ints if all(str(i) == v for i, v in zip(ints, vocabulary)) else None


def numbers(values: Any) -> np.ndarray:
    """A numeric column as float64, a missing value NaN. Text is refused by the caller before it comes here (a
    streamed shard's column types are checked), or parsed: ``""`` and ``"?"`` are missing."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = as_arrow(values)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        trimmed = pc.utf8_trim_whitespace(arr)
        arr = pc.if_else(pc.is_in(trimmed, value_set=pa.array(["", "?"])), pa.scalar(None, trimmed.type), trimmed)
    return arr.cast(pa.float64()).to_numpy(zero_copy_only=False)


def standardised(x: np.ndarray, mean: float, std: float, log1p: bool) -> np.ndarray:
    """``(x' - mean) / std`` as float32, ``x' = sign(x) log1p(|x|)`` where asked, a missing value the mean."""
    if log1p:
        x = np.sign(x) * np.log1p(np.abs(x))
    x = np.where(np.isnan(x), mean, x)
    return ((x - mean) / std).astype(np.float32)


def list_values(values: Any) -> tuple["pa.Array", np.ndarray]:
    """A multi-hot column's values as trimmed text, flat, and the row each belongs to: lists (parquet, json) or
    ``a|b|c`` text (csv); empty values dropped (``tabular._lists``' rule)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = as_arrow(values)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        arr = pc.split_pattern(pc.fill_null(arr, ""), "|")
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise TypeError(f"holds {arr.type} values, not lists")
    rows = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
    flat = text(pc.list_flatten(arr))
    keep = pc.not_equal(flat, "")
    return flat.filter(keep), rows[keep.to_numpy(zero_copy_only=False)]


def bag_ids(values: Any, lookup: Lookup, length: int) -> np.ndarray:
    """``[rows, length]`` ids of each row's list, its first ``length`` values, 0 after them and for an unknown value."""
    flat, rows = list_values(values)
    n = len(as_arrow(values))
    out = np.zeros((n, length), dtype=np.int64)
    if not len(rows):
        return out
    counts = np.bincount(rows, minlength=n)
    pos = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    keep = pos < length
    out[rows[keep], pos[keep]] = lookup(flat)[keep]
    return out
