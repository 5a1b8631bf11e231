"""Times measured, not typed (issue 42, item 6): minilm-embed was "about 3 minutes" in the README, "9.9 minutes" in its
header and 16.5 on a user's machine; `make demo` "well under two minutes" took 3.6 plus 2.3 of first build.

Every duration the README states comes from ``benchmarks/results/timings.json`` (which ``benchmarks/timings.py``
writes, each figure with its host, load and commit) or from a results file its paragraph cites, and is checked against
it here. In docs/, DEVELOPERS.md and the recipes' comments, a paragraph stating a duration cites the results file that
measured it, and the figure is found there. A setting (a default of 20 s, a report every 30 s) is not a measurement:
those are listed below by their words.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import REPO

TIMINGS = REPO / "benchmarks" / "results" / "timings.json"
NUMBER = r"\d[\d,]*(?:\.\d+)?|one|two|three|four|five|six|seven|eight|nine|ten|twelve|fifteen|twenty|thirty"
UNITS = {"s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
         "hour": 3600, "hours": 3600}
DURATION = re.compile(rf"(?<![\w.@$/-])({NUMBER})(?:\s*(?:-|–|to)\s*({NUMBER}))?\s*({'|'.join(sorted(UNITS, key=len, reverse=True))})\b(?![-/])")
WORDS = {w: n for n, w in enumerate("zero one two three four five six seven eight nine ten".split())} | {
    "twelve": 12, "fifteen": 15, "twenty": 20, "thirty": 30}
CITED = re.compile(r"benchmarks/results/([\w.-]+\.(?:md|json))")

#: Durations that are settings, not measurements: the words around them.
SETTINGS = ("or for 20 s if that comes first", "200 runs or 20 s", "every 30 s", "(2 min 3 s)", "past 30 s its report says so")


def value(text: str) -> float:
    return float(WORDS.get(text, None) if text in WORDS else text.replace(",", ""))


def durations(text: str) -> list[tuple[str, float, float]]:
    """``(as written, low, high)`` in seconds for each duration in ``text`` (a range gives both ends)."""
    found = []
    for m in DURATION.finditer(text):
        if m.group(1).isalpha() and not re.search(r"[a-z]\s+[a-z]", m.group(0)):  # "ones" is not one second
            continue
        scale = UNITS[m.group(3)]
        low = value(m.group(1)) * scale
        found.append((m.group(0), low, value(m.group(2)) * scale if m.group(2) else low))
    return found


def paragraphs(path: Path) -> list[str]:
    """Markdown paragraphs (blank-line separated); for a recipe, its runs of comment lines."""
    text = path.read_text()
    if path.suffix == ".md":
        return re.split(r"\n\s*\n", text)
    blocks, block = [], []
    for line in text.splitlines():
        comment = line.partition("#")[2] if "#" in line else ""
        if comment:
            block.append(comment)
        elif block:
            blocks.append(" ".join(block))
            block = []
    return blocks + ([" ".join(block)] if block else [])


def _precision(written: str) -> float:
    """Half the last written digit, in the figure's unit: 40.0 -> 0.05, 2,401 -> 0.5, about ten -> 0.5."""
    number = re.match(rf"({NUMBER})", written).group(1)
    decimals = len(number.partition(".")[2])
    return 0.5 * 10 ** -decimals


def measured_in(figure: tuple[str, float, float], cited: list[str]) -> bool:
    """The figure (to its written precision) is a duration one of the cited results files states."""
    written, low, high = figure
    tolerance = _precision(written) * UNITS[DURATION.match(written).group(3)] + 1e-9
    for name in cited:
        path = REPO / "benchmarks" / "results" / name
        if not path.is_file():
            continue
        text = path.read_text()
        if name == "timings.json":
            seconds = [e["seconds"] for e in json.loads(text)["entries"].values()]
            stated = [(s, s) for s in seconds]
        else:
            stated = [(lo, hi) for _, lo, hi in durations(text)]
        if any(abs(lo - low) <= tolerance and abs(hi - high) <= tolerance for lo, hi in stated):
            return True
    return False


def unsourced(path: Path) -> list[str]:
    problems = []
    for para in paragraphs(path):
        flat = " ".join(para.split())
        cited = CITED.findall(flat)
        for figure in durations(flat):
            if any(figure[0] in s and s in flat for s in SETTINGS):
                continue
            if not measured_in(figure, cited):
                problems.append(f"{path.relative_to(REPO)}: {figure[0]!r} in: …{flat[max(0, flat.find(figure[0]) - 90):flat.find(figure[0]) + 40]}…"
                                f" (cites {cited or 'no results file'})")
    return problems


def test_the_duration_finder_reads_figures_ranges_and_words():
    assert [(w, lo, hi) for w, lo, hi in durations("took 40.0 minutes (2,401 s), 18.7-27.4 minutes, about two minutes")] == [
        ("40.0 minutes", 2400.0, 2400.0), ("2,401 s", 2401.0, 2401.0), ("18.7-27.4 minutes", 1122.0, 1644.0),
        ("two minutes", 120.0, 120.0)]
    assert durations("p50 0.58 ms, 1.21 M MACs, --duration S, a 60-s budget, 8x8, the ones it names") == []


def test_the_readme_states_only_durations_measured_in_a_results_file():
    readme = REPO / "README.md"
    assert unsourced(readme) == []
    entries = json.loads(TIMINGS.read_text())["entries"]
    text = " ".join(readme.read_text().split())
    for key in re.findall(r"`([\w-]+)` in benchmarks/results/timings\.json", text):
        assert key in entries, f"README cites timings.json's {key!r}, which benchmarks/timings.py has not measured"


@pytest.mark.parametrize("path", [REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md")),
                                  *sorted((REPO / "recipes").glob("*.yaml"))], ids=lambda p: p.name)
def test_every_duration_in_the_docs_and_recipes_is_measured_in_the_file_it_cites(path):
    assert unsourced(path) == []


def test_every_timing_records_its_host_load_and_commit():
    entries = json.loads(TIMINGS.read_text())["entries"]
    assert {"make-demo-fresh", "demo", "nncf-build", "test-fast"} <= set(entries)
    for name, entry in entries.items():
        assert entry["seconds"] > 0 and entry["command"] and entry["commit"], name
        assert entry["host"]["cpu"] and entry["host"]["usable_cpus"] >= 1 and len(entry["load_average"]) == 2, name
