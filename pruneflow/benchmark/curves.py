"""A figure against batch size as inline SVG line charts (no script, nothing fetched).

x is the batch size on a log2 axis (1, 2, 4 … 256 evenly apart); y is linear from zero, or logarithmic when the
values span more than ``LOG_SPAN`` times (a batch-1 latency of 0.3 ms beside a batch-256 one of 60 ms). Every point
is labelled with its value, every line with its name at the right (pushed apart so that names never overlap, with a
leader to the line's end). A horizontal rule marks a budget; a ring marks a chosen point (the best batch under it).
Charts drawn with one ``Axes`` share its scales, so two hosts or two runtimes compare by eye.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

#: Above this max/min ratio the y axis turns logarithmic.
LOG_SPAN = 20.0
#: Dash patterns, one per runtime lane (solid first), so colour can name the artifact.
DASHES = ("", "8 4", "2 4", "10 4 2 4", "4 2")
WIDTH, HEIGHT = 1100, 320
LEFT, RIGHT, TOP, BOTTOM = 70, 340, 30, 44
#: Up to this many lines every point carries its value; past it, only ringed points do, and each name its last value.
LABEL_ALL = 4
#: Line names longer than this are cut (with an ellipsis) to fit right of the plot.
NAME_CHARS = 52
LABEL_GAP = 14


@dataclass
class Series:
    """One line: ``(batch, value)`` points in batch order; ``ring``: the batch to circle."""

    name: str
    colour: str
    dash: str
    points: list[tuple[int, float]]
    ring: int | None = None


@dataclass
class Axes:
    batches: list[int]
    y_lo: float
    y_hi: float
    log_y: bool

    @classmethod
    def fit(cls, series: list[Series], rule: float | None = None) -> "Axes":
        """Scales that hold every point of ``series`` (and the rule)."""
        batches = sorted({b for s in series for b, _ in s.points}) or [1]
        values = [v for s in series for _, v in s.points if v > 0] + ([rule] if rule else [])
        lo, hi = (min(values), max(values)) if values else (1.0, 1.0)
        if hi / lo > LOG_SPAN:
            return cls(batches, lo / 1.3, hi * 1.3, True)
        return cls(batches, 0.0, hi * 1.15 or 1.0, False)

    @classmethod
    def shared(cls, groups: list[list[Series]], rule: float | None = None) -> "Axes":
        """One scale for several charts."""
        return cls.fit([s for group in groups for s in group], rule)

    def px(self, batch: float) -> float:
        first, last = math.log2(self.batches[0]), math.log2(self.batches[-1])
        share = 0.5 if last == first else (math.log2(batch) - first) / (last - first)
        return LEFT + 20 + share * (WIDTH - LEFT - RIGHT - 40)

    def py(self, value: float) -> float:
        if self.log_y:
            value = max(value, self.y_lo)
            share = (math.log10(value) - math.log10(self.y_lo)) / (math.log10(self.y_hi) - math.log10(self.y_lo))
        else:
            share = (value - self.y_lo) / (self.y_hi - self.y_lo)
        return TOP + (1 - share) * (HEIGHT - TOP - BOTTOM)

    def y_ticks(self) -> list[float]:
        if not self.log_y:
            step = _nice_step(self.y_hi / 5)
            return [i * step for i in range(int(self.y_hi / step) + 1)]
        ticks = []
        for power in range(math.floor(math.log10(self.y_lo)), math.ceil(math.log10(self.y_hi)) + 1):
            ticks += [m * 10.0 ** power for m in (1, 2, 5) if self.y_lo <= m * 10.0 ** power <= self.y_hi]
        return ticks


def _nice_step(raw: float) -> float:
    power = 10.0 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def line_chart(series: list[Series], axes: Axes, y_title: str, x_title: str = "batch size (log scale)",
               rule: float | None = None, rule_label: str = "") -> str:
    """One chart: frame, ticks, the rule, every line with labelled points, names at the right."""
    scale = " (log scale)" if axes.log_y else ""
    out = [f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
           'fill="none" stroke="#999"/>', _text(LEFT, HEIGHT - 6, x_title), _text(4, TOP - 12, y_title + scale, 11)]
    for b in axes.batches:
        out += [_line(axes.px(b), HEIGHT - BOTTOM, axes.px(b), HEIGHT - BOTTOM + 4, "#999"),
                _text(axes.px(b) - 4 * len(str(b)), HEIGHT - BOTTOM + 16, str(b), 11)]
    for tick in axes.y_ticks():
        y = axes.py(tick)
        out += [_line(LEFT, y, WIDTH - RIGHT, y, "#eee"), _text(LEFT - 6 - 6 * len(_fmt(tick)), y + 4, _fmt(tick), 11)]
    if rule is not None and axes.y_lo <= rule <= axes.y_hi:
        y = axes.py(rule)
        out += [f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#c00" stroke-dasharray="6 3"/>',
                _text(LEFT + 6, y - 4, rule_label, 11)]
    for s in series:
        out += _series(s, axes, every=len(series) <= LABEL_ALL)
    out += _names(series, axes, every=len(series) <= LABEL_ALL)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">'
            + "".join(out) + "</svg>")


def _fmt(value: float) -> str:
    """3 significant digits, thousands whole with separators (1,062 rather than 1.06e+03)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _series(s: Series, axes: Axes, every: bool) -> list[str]:
    xy = [(axes.px(b), axes.py(v), b, v) for b, v in s.points]
    dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
    out = []
    if len(xy) > 1:
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in xy)
        out.append(f'<polyline points="{path}" fill="none" stroke="{s.colour}" stroke-width="2.5"{dash}/>')
    for i, (x, y, b, v) in enumerate(xy):
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{s.colour}"/>')
        if every or b == s.ring:
            out.append(_text(x + 5, y - 6, _fmt(v), 10))
        if b == s.ring:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="10" fill="none" stroke="{s.colour}" stroke-width="2.5"/>')
    return out


def _names(series: list[Series], axes: Axes, every: bool) -> list[str]:
    """Each line's name right of the plot, at its last point's height, pushed apart to ``LABEL_GAP`` (with the last
    point's value when the points carry none)."""
    ends = sorted(((axes.py(s.points[-1][1]), axes.px(s.points[-1][0]), s) for s in series if s.points),
                  key=lambda e: e[0])
    out, floor = [], -math.inf
    for y, x, s in ends:
        at = max(y, floor + LABEL_GAP)
        floor = at
        name = s.name if len(s.name) <= NAME_CHARS else s.name[:NAME_CHARS - 1] + "…"
        name += "" if every else f"  {_fmt(s.points[-1][1])}"
        out += [_line(x + 6, y, WIDTH - RIGHT + 8, at, s.colour),
                _text(WIDTH - RIGHT + 12, at + 4, name, 11)]
    return out


def _line(x1: float, y1: float, x2: float, y2: float, colour: str) -> str:
    return f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{colour}"/>'


def _text(x: float, y: float, text: str, size: int = 12) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}">{escape(text)}</text>'
