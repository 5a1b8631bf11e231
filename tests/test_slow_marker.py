"""The `slow` marker follows what a test does (tests/conftest.py): a fixture marked @runs_a_recipe makes its
tests slow, and a test not marked slow that runs a recipe end to end (in-process or `optimize` in a
subprocess) fails, naming the mark it lacks; so `make test-fast` runs no end-to-end recipe."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

import conftest
import pruneflow.pipeline as pipeline


class FakeItem:
    def __init__(self, nodeid: str, slow: bool = False, fixtures: tuple = ()):
        self.nodeid, self.markers = nodeid, ["slow"] if slow else []
        self._fixtureinfo = SimpleNamespace(name2fixturedefs={f.__name__: [SimpleNamespace(func=f)] for f in fixtures})

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None

    def add_marker(self, mark) -> None:
        self.markers.append(mark.name)


@pytest.fixture
def running(monkeypatch):
    """Pretend ``item`` is the test running now; forget what the guard recorded about it afterwards."""
    def run(item: FakeItem) -> FakeItem:
        monkeypatch.setitem(conftest._RUNNING, "item", item)
        return item

    yield run
    conftest._UNMARKED.pop("tests/fake.py::test_x", None)


def test_a_fixture_marked_runs_a_recipe_makes_its_tests_slow():
    @conftest.runs_a_recipe
    def a_run():
        pass

    def plain():
        pass

    items = [FakeItem("a", fixtures=(plain, a_run)), FakeItem("b", fixtures=(plain,))]
    conftest.pytest_collection_modifyitems(items)
    assert [item.markers for item in items] == [["slow"], []]


def test_a_recipe_run_in_a_test_not_marked_slow_fails_it_before_any_stage(running):
    running(FakeItem("tests/fake.py::test_x"))
    loaded = SimpleNamespace(recipe=SimpleNamespace(name="tiny"))
    with pytest.raises(pytest.fail.Exception, match=r"test_x runs the recipe 'tiny' end to end .* not marked slow"):
        pipeline._run_locked(loaded)  # refused before it reads its other arguments
    assert "@pytest.mark.slow" in conftest._UNMARKED["tests/fake.py::test_x"]


@pytest.mark.parametrize("argv", [["-m", "cli", "optimize", "r.yaml"], ["-m", "pruneflow", "optimize", "r.yaml", "--json"]])
def test_optimize_in_a_subprocess_of_a_test_not_marked_slow_fails_it(running, argv):
    running(FakeItem("tests/fake.py::test_x"))
    with pytest.raises(pytest.fail.Exception, match="in a subprocess but is not marked slow"):
        subprocess.Popen([sys.executable, *argv])


def test_a_test_marked_slow_may_run_recipes_and_other_subprocesses_are_left_alone(running):
    running(FakeItem("tests/fake.py::test_x", slow=True))
    conftest.refuse_unless_slow("a recipe")
    running(FakeItem("tests/fake.py::test_x"))
    done = subprocess.run([sys.executable, "-c", "print('optimize')"], capture_output=True, text=True, check=True)
    assert done.stdout == "optimize\n" and "tests/fake.py::test_x" not in conftest._UNMARKED
