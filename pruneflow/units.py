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
