"""Proof that a format is one file and a registration (issue 40): a third party's format (tests/plugins/pf_ortm.py,
registered through a ``pruneflow.formats`` entry point, as an installed package would) is loaded by the runtime
layer and timed by ``bench``, with no suffix or name of it anywhere in pruneflow."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from conftest import invoke, plugin_installed



@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """pf_ortm installed as a distribution would be: the module on sys.path, its entry point in a dist-info."""
    from pruneflow import registry

    with plugin_installed(tmp_path_factory.mktemp("site"), "pf_ortm", registry.formats, "ortm = pf_ortm:OrtModel") as site:
        yield site


@pytest.fixture(scope="module")
def model_file(installed, tmp_path_factory):
    from pruneflow.export.onnx import export_onnx

    folder = tmp_path_factory.mktemp("ortm")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    export_onnx(model, torch.randn(2, 8), folder / "model.onnx")
    shutil.copy(folder / "model.onnx", folder / "model.fp32.ortm")
    return folder / "model.fp32.ortm", model


def test_the_plugin_format_is_registered_and_owns_its_suffix(installed):
    from pruneflow.formats import format_of, runtimes_for

    assert format_of("x/model.fp32.ortm").name == "ortm" and runtimes_for("a.ortm") == ("onnxruntime",)


def test_the_runtime_layer_opens_the_plugin_format_and_computes_the_model(model_file):
    from pruneflow.runtime import open_artifact

    path, model = model_file
    x = torch.randn(4, 8)
    executor = open_artifact(path)
    assert executor.runtime == "onnxruntime"
    assert torch.allclose(torch.from_numpy(executor(x.numpy())), model(x), atol=1e-5)


def test_bench_times_the_plugin_format(model_file, tmp_path):
    path, _ = model_file
    result = invoke("bench", path, "--runs", "5", "--warmup", "1", "--threads", "1", "--batch", "1,4", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert {(r["runtime"], r["batch"]) for r in rows} == {("onnxruntime", 1), ("onnxruntime", 4)}
    assert all(r["p50_ms"] > 0 and r["precision"] == "fp32" and r["label"] == "model.fp32.ortm" for r in rows)
