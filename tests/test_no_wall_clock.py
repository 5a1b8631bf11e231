"""No test asserts an upper bound on wall-clock time (issue 42, item 7): on a busy laptop or CI's shared cores
`seconds < 30` measured 37.5 s and turned the suite red with nothing broken. A speed bound lives in the doctor's
own report (its ``slow`` note) and in benchmarks/timings.py's results, with the host they were measured on.

Read with ``ast`` (nothing is imported): an ``assert`` comparing something timed (``seconds``, ``elapsed``,
``perf_counter()``, ``monotonic()``, ``time.time()``) as smaller than a bound fails here, naming its line. A lower
bound (``seconds > 0``, ``>= 0.05`` after a sleep) is a fact about the code and stays. A subprocess's ``timeout=``
is a guard against hanging forever, not an assert, and stays too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TIMED = re.compile(r"^(seconds|elapsed|duration|took|perf_counter|monotonic|time)$")


def _timed(node: ast.AST) -> bool:
    """A name, attribute or subscript key that reads as a time (not a string that merely mentions one)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and TIMED.match(n.id) and n.id != "time":
            return True
        if isinstance(n, ast.Attribute) and TIMED.match(n.attr):
            return True
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and TIMED.match(str(n.slice.value)):
            return True
    return False


def wall_clock_bounds(source: str) -> list[int]:
    """Lines of the asserts that bound something timed from above."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assert):
            continue
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [compare.left, *compare.comparators]
            for op, left, right in zip(compare.ops, sides, sides[1:]):
                if (isinstance(op, (ast.Lt, ast.LtE)) and _timed(left)) or (isinstance(op, (ast.Gt, ast.GtE)) and _timed(right)):
                    found.append(node.lineno)
    return sorted(set(found))


def test_the_finder_catches_an_upper_bound_and_leaves_lower_bounds_alone():
    source = ("assert seconds < 30\nassert report['seconds'] < 60\nassert 120 > elapsed\n"
              "assert time.perf_counter() - start < 2\nassert ok and took <= 5\n"
              "assert seconds > 0\nassert time.perf_counter() - start >= 0.05\nassert stage['seconds'] >= 0\n"
              "assert len(x) < 3\n")
    assert wall_clock_bounds(source) == [1, 2, 3, 4, 5]


def test_no_test_asserts_a_wall_clock_upper_bound():
    offenders = [f"{path.name}:{line}" for path in sorted(TESTS.rglob("*.py")) if path.name != Path(__file__).name
                 for line in wall_clock_bounds(path.read_text())]
    assert not offenders, f"wall-clock upper bounds in tests (move them to benchmarks/timings.py): {offenders}"
