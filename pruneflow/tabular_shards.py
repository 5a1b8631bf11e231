"""The shards of a streamed tabular log: found (a file, a folder or a glob), checked, and read in record batches.

Reader: ``pyarrow.dataset`` (chosen over ``datasets`` streaming). It reads Parquet and CSV shards as Arrow record
batches with column projection and no on-disk copy (``datasets`` first converts each file into its Arrow cache: a
second copy of a day of logs), gives each Parquet file's row groups and row counts from its footer without reading
a row (so a rank is handed a row range, and a bad shard is refused before any training), and hands the columns to the
vectorised encoder (``tabular_arrow``) as Arrow arrays, without a copy.

A shard is refused (``InputError``, exit 2) naming the file and the column: a column the recipe names that it lacks,
a column of the wrong type (text where numbers go, a list where one value goes), a truncated or corrupt file, a
shard with no rows. Every shard is checked before the counting pass, and the counting pass reads every training row
before the first stage, so no bad shard is met in the middle of training.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from .errors import InputError

if TYPE_CHECKING:
    import pyarrow as pa

#: What each role's column may hold (Arrow type predicates, by name), and how a wrong one is explained.
CATEGORICAL, NUMERIC, LABEL, MULTI_HOT = "categorical", "numeric", "label", "multi_hot"
_NEEDS = {CATEGORICAL: "one id or word a row (integer or text)", NUMERIC: "numbers", LABEL: "numbers or text labels",
          MULTI_HOT: "a list a row (or `a|b|c` text)"}


@dataclass(frozen=True)
class Shard:
    """One file of the log: its row groups' row counts (Parquet: from the footer; CSV: counted when first read)."""

    path: Path
    fmt: str
    groups: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.groups)


@dataclass(frozen=True)
class Piece:
    """Rows ``lo:hi`` of row group ``group`` of shard number ``index`` (what one reader call reads)."""

    index: int
    group: int
    lo: int
    hi: int
    start: int  # the piece's first row, counted from the start of its shard (reservoir keys depend on it)


def shard_files(path: str, fmt: str, field: str) -> list[Path]:
    """The shard files ``path`` names: a file, a folder (its ``*.parquet`` / ``*.csv`` files, sub-folders included,
    hidden ones skipped) or a glob (``logs/day=*/part-*.parquet``), sorted, so every rank sees the same list."""
    if any(ch in path for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
    else:
        p = Path(path)
        if not p.exists():
            raise InputError(f"{field}: file not found: {p}", hint="a file, a folder or a glob of shards")
        files = [p] if p.is_file() else sorted(f for f in p.rglob(f"*.{fmt}") if f.is_file()
                                             and not any(part.startswith((".", "_")) for part in f.relative_to(p).parts))
    if not files:
        raise InputError(f"{field}: no *.{fmt} shard in {path}", hint=f"point at a .{fmt} file, a folder or a glob of them")
    return files


def inspect(files: Sequence[Path], fmt: str, roles: dict[str, str], field: str, options: Any = None,
            hashed: Sequence[str] = ()) -> list[Shard]:
    """Each shard's row groups, after checking that it reads and holds every column of ``roles`` ({column: role})
    with a type its role takes, and that each ``hashed`` column is integer in every shard or in none (an integer is
    its own hash, text is hashed: a mixture would give one id two hashes); CSV shards are typed by ``options``."""
    import pyarrow as pa

    shards: list[Shard] = []
    integer: dict[str, tuple[bool, Path]] = {}
    for f in files:
        schema, groups = _parquet_footer(f, field) if fmt == "parquet" else _csv_head(f, field, options)
        check_columns(schema, roles, f, field)
        for c in hashed:
            kind = schema.field(c).type
            first = integer.setdefault(c, (pa.types.is_integer(kind), f))
            if first[0] != pa.types.is_integer(kind) and not pa.types.is_null(kind):
                raise InputError(f"{field}: column {c!r} of shard {f} holds {kind}, and of shard {first[1]} "
                                 f"{'integers' if first[0] else 'text'}: a hashed field hashes an integer as itself and "
                                 "text by FNV-1a, so every shard must hold the same kind",
                                 hint="write the column with one type in every shard")
        if fmt == "parquet" and not sum(groups):
            raise InputError(f"{field}: shard {f} holds no rows (an empty shard)", hint="remove it or write its rows again")
        shards.append(Shard(f, fmt, groups))
    return shards


def _parquet_footer(f: Path, field: str) -> tuple["pa.Schema", tuple[int, ...]]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(f).metadata
        return meta.schema.to_arrow_schema(), tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError for a bad footer
        raise InputError(f"{field}: shard {f} is not a readable Parquet file (truncated or corrupt: {exc})",
                         hint="write the shard again; a file still being written is read after it is closed") from None


def _csv_head(f: Path, field: str, options: Any) -> tuple["pa.Schema", tuple[int, ...]]:
    """A CSV shard's columns, read from its first block (its row count is learnt when it is read whole)."""
    import pyarrow.csv as pcsv

    try:
        reader = pcsv.open_csv(f, read_options=options[0], convert_options=options[1])
        schema = reader.schema
        first = next(iter(reader), None)
    except StopIteration:
        first = None
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{field}: shard {f}: {_csv_message(exc, f)}", hint="fix or remove the shard") from None
    if first is None or first.num_rows == 0:
        raise InputError(f"{field}: shard {f} holds no rows (an empty shard)", hint="remove it or write its rows again")
    return schema, (-1,)


def check_columns(schema: "pa.Schema", roles: dict[str, str], f: Path, field: str) -> None:
    names = schema.names
    for column, role in roles.items():
        if column not in names:
            raise InputError(f"{field}: shard {f} has no column {column!r} (data.features / label_column name it); its "
                             f"columns are {', '.join(names)}", hint="write the shard with every column, or fix the recipe")
        kind = schema.field(column).type
        if not takes(role, kind):
            raise InputError(f"{field}: column {column!r} of shard {f} holds {kind}, where {role} columns hold "
                             f"{_NEEDS[role]}", hint="write the column with the type of the other shards, or move it to "
                             "the right list of data.features")


def takes(role: str, kind: "pa.DataType") -> bool:
    """Whether a column of Arrow type ``kind`` can serve ``role``."""
    import pyarrow as pa

    t = pa.types
    if t.is_dictionary(kind):
        kind = kind.value_type
    scalar = t.is_integer(kind) or t.is_boolean(kind) or t.is_floating(kind) or t.is_null(kind)
    text = t.is_string(kind) or t.is_large_string(kind)
    if role == NUMERIC:
        return scalar
    if role == MULTI_HOT:
        return t.is_list(kind) or t.is_large_list(kind) or text or t.is_null(kind)
    return scalar or text


def csv_options(roles: dict[str, str]) -> tuple[Any, Any]:
    """How CSV shards are read: numeric columns as float64 (``""``, ``?``, ``NA`` missing), categorical and multi-hot
    ones as text (a missing value ``""``), so every shard gives the same types and a bad value names its column."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    # categorical columns are typed by Arrow's inference (as the in-memory path's): integer ids stay integers, so a
    # hashed field hashes them as integers; a shard whose hashed column infers otherwise is refused (inspect)
    types = {c: pa.float64() if r == NUMERIC else pa.large_string() for c, r in roles.items() if r in (NUMERIC, MULTI_HOT)}
    return (pcsv.ReadOptions(block_size=1 << 22),
            pcsv.ConvertOptions(column_types=types, null_values=["", "?", "NA", "NaN", "null"], strings_can_be_null=False,
                                include_columns=list(roles)))


def _csv_message(exc: Exception, f: Path) -> str:
    """pyarrow's CSV error, with the column it numbers (``In CSV column #3``) named."""
    text = str(exc)
    marker = "In CSV column #"
    if marker in text:
        try:
            import pyarrow.csv as pcsv

            number = int(text.split(marker, 1)[1].split(":", 1)[0])
            names = pcsv.open_csv(f, convert_options=pcsv.ConvertOptions(column_types={})).schema.names
            text = f"column {names[number]!r}: {text}"
        except Exception:  # noqa: BLE001 - the plain message still says what is wrong
            pass
    return text


def pieces(shards: Sequence[Shard], start: int, stop: int) -> list[Piece]:
    """The row-group pieces covering rows ``start:stop`` of the shards taken end to end."""
    out, offset = [], 0
    for index, shard in enumerate(shards):
        in_shard = 0
        for group, n in enumerate(shard.groups):
            lo, hi = max(start - offset, 0), min(stop - offset, n)
            if lo < hi:
                out.append(Piece(index, group, lo, hi, in_shard + lo))
            offset += n
            in_shard += n
    return out


def read(shard: Shard, piece: Piece, columns: Sequence[str], batch_rows: int, field: str,
         options: Any = None) -> Iterator["pa.RecordBatch"]:
    """Rows ``piece.lo:piece.hi`` of one row group as record batches of at most ``batch_rows`` rows."""
    try:
        yield from _batches(shard, piece, columns, batch_rows, options)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - a page that does not decode, a CSV value that does not convert
        raise InputError(f"{field}: shard {shard.path} could not be read: {_csv_message(exc, shard.path)}",
                         hint="write the shard again (truncated or corrupt), or fix the value it names") from None


def _batches(shard: Shard, piece: Piece, columns: Sequence[str], batch_rows: int, options: Any) -> Iterator["pa.RecordBatch"]:
    import pyarrow.csv as pcsv
    import pyarrow.dataset as pads

    if shard.fmt == "parquet":
        fragment = next(pads.dataset(str(shard.path), format="parquet").get_fragments())
        source = fragment.subset(row_group_ids=[piece.group]).to_batches(columns=list(columns), batch_size=batch_rows)
    else:
        source = pcsv.open_csv(shard.path, read_options=options[0], convert_options=options[1])
    seen = 0
    for batch in source:
        lo, hi = max(piece.lo - seen, 0), min(piece.hi - seen, batch.num_rows)
        seen += batch.num_rows
        if lo < hi:
            yield batch.slice(lo, hi - lo).select(list(columns))
        if seen >= piece.hi:
            return


def count_csv_rows(shard: Shard, batch_rows: int, field: str, options: Any) -> Shard:
    """A CSV shard with its row count (one pass over it); an empty one is refused."""
    n = sum(b.num_rows for b in read(shard, Piece(0, 0, 0, 1 << 62, 0), options[1].include_columns, batch_rows, field,
                                     options))
    if not n:
        raise InputError(f"{field}: shard {shard.path} holds no rows (an empty shard)", hint="remove it")
    return Shard(shard.path, shard.fmt, (n,))


def row_keys(seed: int, index: int, first: int, n: int) -> np.ndarray:
    """Reservoir keys in [0, 1) of rows ``first .. first + n - 1`` of shard number ``index``: a hash of the row's place
    (splitmix64), not a draw, so the sample is the same whichever rank reads the row and however the log is split."""
    x = (np.arange(first, first + n, dtype=np.uint64) + np.uint64((index << 40) & 0xFFFFFFFFFFFFFFFF)
         + np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF))
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
