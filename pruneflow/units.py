"""Figures as people read them: ``1.21 M`` MACs, ``28.92 KiB`` (report.md, the terminal, the headline)."""

from __future__ import annotations


def human_int(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


def human_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def cell(value: object) -> str:
    """One table cell: floats to four significant digits (a share to four places), None blank, the rest as text."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1 else f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def text_table(rows: list[dict], columns: list[str] | None = None, *, max_rows: int = 30, max_width: int = 48) -> str:
    """A plain fixed-width table of ``rows`` (what ``print`` of a result shows, in a terminal or a notebook):
    columns that are blank in every row are left out, a cell past ``max_width`` characters is cut with "…", and past
    ``max_rows`` rows the rest are counted on a last line.

    >>> print(text_table([{"what": "MACs", "change": "2.08x fewer"}]))
    what  change
    MACs  2.08x fewer
    """
    columns = [c for c in (columns or list(dict.fromkeys(k for r in rows for k in r))) if any(cell(r.get(c)) for r in rows)]
    shown = [[_cut(cell(r.get(c)), max_width) for c in columns] for r in rows[:max_rows]]
    widths = [max([len(c)] + [len(row[i]) for row in shown]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in shown]
    if len(rows) > max_rows:
        lines.append(f"… {len(rows) - max_rows} more rows")
    return "\n".join(lines)


def _cut(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def dataframe(records: list[dict]):
    """``records`` as a pandas DataFrame (pandas is optional: MissingDependencyError says how to get it)."""
    try:
        import pandas  # type: ignore[import-untyped]
    except ImportError as exc:
        from .errors import MissingDependencyError

        raise MissingDependencyError("to_pandas() needs pandas, which pruneflow does not install",
                                     hint="pip install pandas; to_records() gives the same rows as a list of dicts") from exc
    return pandas.DataFrame.from_records(records)
