"""Registries: entry-point loading, unknown names, broken plugins."""

from __future__ import annotations

import pytest

from pruneflow import registry
from pruneflow.errors import PluginError, UnknownNameError
from pruneflow.registry import Registry


def test_builtins_arrive_through_entry_points():
    assert {"train", "evaluate", "export"} <= set(registry.stages.names())
    assert "onnx" in registry.targets.names()
    assert registry.stages.get("train").__name__ == "TrainStage"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownNameError) as err:
        registry.stages.get("trian")
    assert "did you mean 'train'" in str(err.value) and "evaluate" in str(err.value)
    assert err.value.exit_code == 2


class _BrokenEntryPoint:
    name = "broken"
    value = "nowhere.module:Thing"

    def load(self):
        raise ImportError("No module named 'nowhere'")


def test_a_plugin_that_fails_to_import_is_an_error_naming_it():
    reg = Registry("stage type", "pruneflow.test-nothing")
    reg._entry_points = {"broken": _BrokenEntryPoint()}
    assert reg.names() == ["broken"]
    with pytest.raises(PluginError) as err:
        reg.get("broken")
    assert "broken" in str(err.value) and "nowhere" in str(err.value)


def test_register_decorator():
    reg = Registry("thing", "pruneflow.test-nothing")

    @reg.register("mine")
    class Mine:
        pass

    assert reg.get("mine") is Mine and reg.names() == ["mine"]
