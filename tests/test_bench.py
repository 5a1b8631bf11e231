"""`pruneflow bench` on real tiny runs: figures consistent in JSON, Prometheus text that parses, an HTML
report that renders its charts in headless Chromium, and the exit codes of wrong arguments.

Two untrained runs (evaluate + export of digits_cnn at widths 8 and 16, onnx and openvino, fp32 and fp16)
are made once for the module in about two seconds; every bench call uses --runs 5 on 1 thread.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import invoke, run_recipe_dict, runs_a_recipe, tiny_recipe_dict

FAST = ["--runs", "5", "--warmup", "1", "--threads", "1"]


def no_train_run(folder: Path, name: str, width: int) -> Path:
    recipe = tiny_recipe_dict(name=name, model={"factory": "digits_cnn", "kwargs": {"width": width}})
    recipe["stages"] = [{"type": "evaluate"},
                        {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "fp16"],
                         # untrained: near-tied logits, so OpenVINO's bf16 default flips a few top-1s
                         "latency": None, "parity": {"min_top1_agreement": 0.9}}]
    folder.mkdir(parents=True, exist_ok=True)
    _, result = run_recipe_dict(recipe, folder)
    assert result.exit_code == 0
    return result.run_dir


@pytest.fixture(scope="module")
@runs_a_recipe
def runs(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    return no_train_run(tmp / "a", "narrow", 8), no_train_run(tmp / "b", "wide", 16)


@pytest.fixture(scope="module")
def ab_json(runs, tmp_path_factory) -> dict:
    """Both runs side by side at batch 1 and 4, every output asked for."""
    out = tmp_path_factory.mktemp("bench-out")
    result = invoke("bench", *runs, *FAST, "--batch", "1,4", "--json", out / "bench.json", "--html", out / "bench.html",
                    "--prometheus", out / "bench.prom")
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text(), parse_constant=_no_constants)
    data["_out"], data["_stdout"] = out, result.stdout
    return data


def _no_constants(name: str):
    raise AssertionError(f"{name} in JSON: not strict JSON")


def test_every_artifact_is_timed_on_every_runtime_that_loads_it_at_every_batch(ab_json):
    got = {(r["variant"], r["runtime_label"].split()[0], r["precision_hint"], r["batch"]) for r in ab_json["results"]}
    # OpenVINO's f32 lane is timed beside its default where the default is not f32 (a bf16 CPU); on an AVX2-only
    # host the default is f32 and one lane serves
    bf16 = any(r["inference_precision"] == "bf16" for r in ab_json["results"])
    hints = ("default", "f32") if bf16 else ("default",)
    for run in ("narrow", "wide"):
        for batch in (1, 4):
            for precision in ("fp32", "fp16"):
                assert (f"{run}/onnx.{precision}", "onnxruntime/CPU", None, batch) in got
                for hint in hints:
                    assert (f"{run}/onnx.{precision}", "openvino/CPU", hint, batch) in got
                    assert (f"{run}/openvino.{precision}", "openvino/CPU", hint, batch) in got
    lanes = 1 + 2 * len(hints)  # onnxruntime, and OpenVINO on the ONNX and on the IR at each hint
    assert len(ab_json["results"]) == 2 * 2 * 2 * lanes  # runs x precisions x batches x lanes
    assert ab_json["baseline"] == "narrow/onnx.fp32"  # the first fp32 artifact
    assert all(r["error"] is None and r["runs"] == 5 for r in ab_json["results"])


def test_each_rows_headline_is_the_one_measured_in_that_runtime_and_precision(ab_json):
    """The export stage evaluates an IR at OpenVINO's default and at f32, and an ONNX in onnxruntime: a row shows
    the figure of its own runtime and precision, and none for an ONNX timed in OpenVINO (measured elsewhere)."""
    variants = {v["name"]: v for v in ab_json["variants"]}
    for r in ab_json["results"]:
        v = variants[r["variant"]]
        assert r["variant_metric_value"] == v["metric_value"] is not None
        if r["runtime"] == "onnxruntime":
            assert r["metric_value"] == v["measured_in"]["onnxruntime"] == v["metric_value"]
        elif v["target"] == "onnx":
            assert r["metric_value"] is None
        else:
            assert r["metric_value"] == v["measured_in"][f"openvino/{r['inference_precision']}"]
    ir = variants["narrow/openvino.fp32"]["measured_in"]
    assert set(ir) <= {"openvino/bf16", "openvino/f32"} and "openvino/f32" in ir
    assert "accuracy: as each run measured it in that runtime and precision" in ab_json["_stdout"]
    assert "as each run measured it" in (ab_json["_out"] / "bench.html").read_text()


def test_json_figures_are_consistent(ab_json):
    rows = ab_json["results"]
    base = {(r["runtime_label"], r["batch"]): r for r in rows if r["variant"] == ab_json["baseline"]}
    sizes = {v["name"]: v for v in ab_json["variants"]}
    for r in rows:
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["throughput"] == pytest.approx(r["batch"] * 1000 / r["p50_ms"])
        ref = base[(r["baseline_runtime"], r["batch"])]
        assert r["baseline_runtime"] == r["runtime_label"]  # the baseline ran on every runtime here
        assert r["speedup"] == pytest.approx(ref["p50_ms"] / r["p50_ms"])
        assert r["size_reduction"] == pytest.approx(sizes[ab_json["baseline"]]["size_bytes"] / r["size_bytes"])
        assert r["metric"] == "accuracy" and r["metric_direction"] == "higher"  # the classification task's headline
        if r["metric_value"] is None:  # not measured in this runtime and precision (test below)
            assert r["metric_delta"] is None
        else:
            assert r["metric_delta"] == pytest.approx(r["metric_value"] - sizes[ab_json["baseline"]]["metric_value"])
        assert r["shape"] == [r["batch"], 1, 8, 8]
    # sizes on disk: an IR counts its .bin, and the wider model is bigger
    ir = sizes["narrow/openvino.fp32"]
    xml = Path(ir["path"])
    assert ir["size_bytes"] == xml.stat().st_size + xml.with_suffix(".bin").stat().st_size
    assert sizes["wide/onnx.fp32"]["size_bytes"] > sizes["narrow/onnx.fp32"]["size_bytes"]
    assert all(v["metric_value"] is not None and "eval split of digits" in v["timed_on"] for v in ab_json["variants"])


def test_openvino_default_and_forced_f32_are_both_reported_and_labelled(ab_json):
    ov = [r for r in ab_json["results"] if r["runtime"] == "openvino"]
    forced = [r for r in ov if r["precision_hint"] == "f32"]
    default = [r for r in ov if r["precision_hint"] == "default"]
    assert default
    isa = ab_json["host"]["cpu"]["isa"]
    if "avx512_bf16" in isa or "amx_bf16" in isa:  # this machine: OpenVINO computes fp32 IR in bf16 by default
        assert forced and {r["inference_precision"] for r in forced} == {"f32"}
        assert {r["inference_precision"] for r in default} == {"bf16"}
        assert {r["runtime_label"] for r in default} == {"openvino/CPU default=bf16"}
    else:  # the default is f32 already: no second lane to force, and the label says what the default ran
        assert not forced and {r["inference_precision"] for r in default} == {"f32"}
        assert {r["runtime_label"] for r in default} == {"openvino/CPU default=f32"}


def test_host_and_settings_are_recorded(ab_json):
    assert ab_json["format"] == "pruneflow-bench/1"
    cpu = ab_json["host"]["cpu"]
    assert cpu["model"] and cpu["arch"] and isinstance(cpu["isa"], list)
    assert "onnxruntime" in ab_json["host"]["versions"]
    assert ab_json["settings"]["batches"] == [1, 4] and ab_json["settings"]["runs"] == 5
    assert ab_json["settings"]["threads"] == 1
    assert "host: " in ab_json["_stdout"] and "ratios against narrow/onnx.fp32" in ab_json["_stdout"]


# --------------------------------------------------------------------------- Prometheus

SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$')
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"\s*(,|$)')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The text exposition format's grammar: HELP and TYPE once per family, before its samples; samples
    ``name{label="escaped value",...} float``; no timestamps."""
    samples, typed, helped = [], {}, set()
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in helped
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("gauge", "counter", "summary", "histogram", "untyped") and name not in typed
            typed[name] = kind
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name = match["name"]
            assert name in typed and name in helped, f"{name} has no TYPE/HELP before its samples"
            labels, rest = {}, match["labels"] or ""
            while rest:
                label = LABEL.match(rest)
                assert label, f"bad labels in {line!r}"
                labels[label[1]] = re.sub(r'\\(.)', lambda m: {"n": "\n"}.get(m[1], m[1]), label[2])
                rest = rest[label.end():]
            samples.append((name, labels, float(match["value"])))
    return samples


def test_prometheus_file_parses_and_holds_every_figure(ab_json):
    samples = parse_prometheus((ab_json["_out"] / "bench.prom").read_text())
    assert not [name for name, _, _ in samples if name.endswith("_ms")]  # Prometheus' unit: seconds
    latency = [(labels, v) for name, labels, v in samples if name == "pruneflow_latency_seconds"]
    assert len(latency) == 3 * len(ab_json["results"])
    keys = {tuple(sorted(labels.items())) for labels, _ in latency}
    assert len(keys) == len(latency)  # no duplicate series
    row = ab_json["results"][0]
    wanted = {"host": ab_json["host"]["cpu"]["model"], "model": row["model"], "variant": row["label"],
              "runtime": row["runtime_label"], "precision": row["precision"], "batch": str(row["batch"])}
    by_quantile = {labels["quantile"]: v for labels, v in latency if {**labels, "quantile": ""} == {**wanted, "quantile": ""}}
    assert by_quantile == pytest.approx({"0.5": row["p50_ms"] / 1000, "0.9": row["p90_ms"] / 1000, "0.99": row["p99_ms"] / 1000})
    names = {name for name, _, _ in samples}
    assert {"pruneflow_throughput", "pruneflow_size_bytes", "pruneflow_metric", "pruneflow_speedup"} <= names
    sizes = {(labels["model"], labels["variant"]): v for name, labels, v in samples if name == "pruneflow_size_bytes"}
    assert sizes[("wide", "onnx.fp16")] == next(v["size_bytes"] for v in ab_json["variants"] if v["name"] == "wide/onnx.fp16")


def test_prometheus_label_values_are_escaped():
    from pruneflow.benchmark.exposition import _sample, escape_label

    assert escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    line = _sample("pruneflow_metric", {"model": 'run "x"\\y\nz', "variant": "onnx.fp32"}, 0.5)
    text = f"# HELP pruneflow_metric a\n# TYPE pruneflow_metric gauge\n{line}\n"
    assert parse_prometheus(text) == [("pruneflow_metric", {"model": 'run "x"\\y\nz', "variant": "onnx.fp32"}, 0.5)]


# --------------------------------------------------------------------------- HTML in a real browser


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must render the HTML report: chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed here (CI installs it and runs this test)")
    return found


def screenshot(html_file: Path, tmp_path: Path, height: int = 1600) -> np.ndarray:
    """The page as headless Chromium draws it: RGB pixels, one row each."""
    from PIL import Image

    png = tmp_path / "shot.png"
    subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", f"--window-size=1200,{height}",
                    html_file.resolve().as_uri()], check=True, capture_output=True, timeout=120)
    return np.asarray(Image.open(png).convert("RGB")).reshape(-1, 3)


def test_html_report_is_self_contained_and_renders_its_charts_in_chromium(ab_json, tmp_path):
    from pruneflow.benchmark.html import PALETTE

    html_file = ab_json["_out"] / "bench.html"
    text = html_file.read_text()
    assert not re.search(r"<script|<link|src=|url\(|https?://(?!www\.w3\.org/2000/svg)", text)  # nothing fetched
    assert text.count("<svg") >= 6  # scatter, sizes, p99 and throughput against batch, one latency chart per batch
    pixels = screenshot(html_file, tmp_path)
    variants = [v for v in ab_json["variants"] if v["status"] == "built"]
    for i in range(len(variants)):  # every variant's colour fills its size and latency bars
        rgb = tuple(int(PALETTE[i][k:k + 2], 16) for k in (1, 3, 5))
        count = int((pixels == rgb).all(axis=1).sum())
        assert count >= 800, f"{PALETTE[i]} ({variants[i]['name']}): {count} pixels"


# --------------------------------------------------------------------------- arguments and exit codes


def test_wrong_arguments_exit_2_naming_the_argument(runs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    note = tmp_path / "notes.txt"
    note.write_text("x")
    cases = [((tmp_path / "nope.onnx",), "nope.onnx: no such file"),
             ((empty,), "without manifest.json"),
             ((note,), "no runtime loads .txt"),
             ((runs[0], "--baseline", "nope"), "--baseline 'nope' names no variant"),
             ((runs[0], "--runtime", "tflite"), "--runtime tflite: unknown runtime"),
             ((runs[0], "--batch", "1,x"), "--batch '1,x'"),
             ((runs[0], "--runs", "5", "--duration", "1"), "--runs and --duration"),
             ((runs[0], "--openvino-precision", "int4"), "--openvino-precision int4"),
             ((runs[0], f"--json={runs[1]}"), "--json took")]
    for args, message in cases:
        result = invoke("bench", *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output.replace("\n", " "), (args, result.output)
        assert "Fix:" in result.output


def test_a_runtime_absent_for_everything_asked_exits_3(tmp_path):
    engine = tmp_path / "model.engine"  # a TensorRT engine: TensorRT cannot exist on this machine
    engine.write_bytes(b"not checked: the runtime is absent")
    result = invoke("bench", engine, *FAST)
    assert result.exit_code == 3, result.output
    assert "tensorrt" in result.output and "Fix:" in result.output


def test_prepared_artifacts_are_listed_without_figures(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["artifacts"].append({"path": "export/tensorrt/model.int8.engine", "kind": "tensorrt", "producer": "export",
                                  "status": "prepared", "target": "tensorrt", "precision": "int8", "form": None,
                                  "metrics": {}, "notes": ["TensorRT absent: build with build_engine.py"], "files": {}})
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = invoke("bench", run, *FAST, "--batch", "1", "--runtime", "onnxruntime", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    prepared = next(v for v in data["variants"] if v["label"] == "tensorrt.int8")
    assert prepared["status"] == "prepared"
    assert not [r for r in data["results"] if r["label"] == "tensorrt.int8"]
    assert {r["runtime"] for r in data["results"]} == {"onnxruntime"}
    table = invoke("bench", run, *FAST, "--batch", "1", "--runtime", "onnxruntime")
    assert "narrow/tensorrt.int8: prepared, not built" in table.output


def test_json_on_stdout_is_one_strict_object_and_duration_sets_the_runs(runs):
    result = invoke("bench", runs[0], "--duration", "0.05", "--warmup", "1", "--threads", "1", "--batch", "2",
                    "--runtime", "onnxruntime", "--json")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0], parse_constant=_no_constants)
    assert data["settings"]["duration"] == 0.05
    assert all(r["runs"] >= 3 and r["batch"] == 2 for r in data["results"])
    assert all(math.isfinite(r["p99_ms"]) for r in data["results"])


def test_a_bare_artifact_is_timed_on_random_input_of_its_shape_and_one_in_a_run_on_its_data(runs, tmp_path):
    bare = tmp_path / "model.fp32.onnx"
    shutil.copy(runs[0] / "export/onnx/model.fp32.onnx", bare)
    result = invoke("bench", bare, runs[0] / "export/openvino/model.fp16.xml", *FAST, "--batch", "3", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    by_name = {v["name"]: v for v in data["variants"]}
    assert by_name[str(bare)]["timed_on"].startswith("random values, shape [B,1,8,8] float32")
    assert by_name[str(bare)]["metric_value"] is None and by_name[str(bare)]["precision"] == "fp32"
    in_run = by_name["narrow/openvino.fp16"]  # found in its run's manifest: label, headline metric and data
    assert in_run["metric_value"] is not None and in_run["timed_on"].startswith("eval split of digits")
    assert data["baseline"] == str(bare)


def test_batches_come_fresh_from_the_eval_split(runs):
    from pruneflow.benchmark.inputs import Feeds
    from pruneflow.benchmark.variants import collect_variants

    variant = collect_variants([runs[0]])[0]
    feeds = Feeds()
    samples = feeds.source(variant).samples
    assert samples is not None and samples.shape[1:] == (1, 8, 8)
    batch = feeds.batch(variant, 150)  # larger than the 100-sample split: samples repeat
    assert batch.shape == (150, 1, 8, 8) and batch.flags["C_CONTIGUOUS"] and batch.dtype == np.float32
    flat = samples.reshape(len(samples), -1)
    assert all((flat == row).all(axis=1).any() for row in batch.reshape(150, -1))


def test_a_static_batch_artifact_reports_the_batches_it_cannot_run(runs, tmp_path):
    import onnx

    model = onnx.load(str(runs[0] / "export/onnx/model.fp32.onnx"))
    for tensor in (*model.graph.input, *model.graph.output):
        tensor.type.tensor_type.shape.dim[0].dim_value = 1
    static = tmp_path / "static.onnx"
    onnx.save(model, str(static))
    result = invoke("bench", static, *FAST, "--batch", "1,4", "--runtime", "onnxruntime", "--json")
    assert result.exit_code == 0, result.output
    rows = {r["batch"]: r for r in json.loads(result.stdout)["results"]}
    assert rows[1]["p50_ms"] > 0 and rows[1]["error"] is None
    assert rows[4]["p50_ms"] is None and rows[4]["error"] == "static batch 1: cannot run batch 4"


def test_benchmark_app_gives_a_second_opinion_on_each_ir(runs):
    from pruneflow.benchmark.appcheck import benchmark_app_command

    prefix, how = benchmark_app_command()
    result = invoke("bench", runs[0] / "export/openvino/model.fp32.xml", *FAST, "--batch", "2", "--benchmark-app",
                    "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["benchmark_app"]["asked"] is True
    if prefix is None:
        assert data["benchmark_app"]["available"] is False and how.startswith("absent")
        return
    assert data["benchmark_app"]["available"] is True
    for row in data["results"]:
        app_result = row["benchmark_app"]
        assert app_result.get("error") is None, app_result
        assert app_result["throughput"] > 0 and app_result["median_ms"] > 0
        assert "-shape [2,1,8,8]" in app_result["command"] and "-niter 100" in app_result["command"]
        assert app_result["iterations"] == 100
        assert ("-infer_precision f32" in app_result["command"]) == (row["precision_hint"] == "f32")


def test_two_runs_of_one_recipe_are_told_apart_by_their_folders(runs, tmp_path):
    from pruneflow.benchmark.variants import collect_variants

    again = tmp_path / "other" / "narrow"
    shutil.copytree(runs[0], again)
    names = [v.name for v in collect_variants([runs[0], again])]
    assert len(set(names)) == len(names) == 8
    assert "runs/narrow/onnx.fp32" in names and "other/narrow/onnx.fp32" in names


@pytest.fixture(scope="module")
@runs_a_recipe
def int8_run(tmp_path_factory) -> Path:
    """A trained, post-training-quantized run exporting fp32 and int8 to onnx and openvino (NNCF: slow)."""
    tmp = tmp_path_factory.mktemp("bench-int8")
    recipe = tiny_recipe_dict(name="int8")
    recipe["stages"] = [{"type": "train", "epochs": 2, "batch_size": 32, "lr": 0.05},
                        {"type": "calibrate", "size": 64}, {"type": "ptq"},
                        {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"],
                         "latency": None}]
    _, result = run_recipe_dict(recipe, tmp)
    assert result.exit_code == 0
    return result.run_dir


@pytest.mark.slow
def test_int8_artifacts_of_a_quantized_run_are_compared_with_its_fp32_baseline(int8_run, tmp_path):
    result = invoke("bench", int8_run, *FAST, "--batch", "1,16", "--json", tmp_path / "b.json", "--html",
                    tmp_path / "b.html")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "b.json").read_text(), parse_constant=_no_constants)
    labels = {r["label"] for r in data["results"] if r["p50_ms"] is not None}
    assert {"onnx.fp32", "onnx.int8", "onnx.int8_tensorrt", "openvino.fp32", "openvino.int8"} <= labels
    assert data["baseline"] == "int8/onnx.fp32"
    variants = {v["label"]: v for v in data["variants"]}
    assert variants["onnx.int8"]["size_reduction"] > 1.5  # int8 weights: fewer bytes than the fp32 baseline
    for row in data["results"]:
        assert row["speedup"] == pytest.approx(
            next(b["p50_ms"] for b in data["results"] if b["variant"] == data["baseline"]
                 and b["runtime_label"] == row["baseline_runtime"] and b["batch"] == row["batch"]) / row["p50_ms"])
        # none for a lane the run did not evaluate (an ONNX in OpenVINO): every variant has one in its own runtime
        assert row["metric_delta"] is None or abs(row["metric_delta"]) <= 0.1
    assert {r["label"] for r in data["results"] if r["metric_delta"] is not None} >= labels
    assert "batch 16 of int8: ratios against int8/onnx.fp32" in result.output  # one run: rows named by label
    assert "│ onnx.int8 " in result.output and "│ openvino.int8 " in result.output


def test_a_forced_f32_lane_is_dropped_where_openvinos_default_is_already_f32(tmp_path):
    from pruneflow.benchmark.measure import Lane, _without_duplicate_f32
    from pruneflow.benchmark.variants import Variant
    from pruneflow.runtime import Executor

    variant = Variant("m/openvino.fp32", "m", "openvino.fp32", tmp_path / "model.xml")

    def lane(hint, used):
        executor = Executor(variant.path, "openvino", "CPU", lambda x: x, {"inference_precision": f"<Type: '{used}'>"})
        return Lane(variant, "openvino", hint, executor)

    avx2_only = [lane(None, "float32"), lane("f32", "float32")]  # a CPU without bf16: one lane is enough
    kept = _without_duplicate_f32(avx2_only)
    assert kept == avx2_only[:1] and kept[0].label == "openvino/CPU default=f32"
    assert "already f32" in variant.notes[0]
    bf16 = [lane(None, "bfloat16"), lane("f32", "float32")]  # this machine's case: both are timed
    assert _without_duplicate_f32(bf16) == bf16
    assert [la.label for la in bf16] == ["openvino/CPU default=bf16", "openvino/CPU f32"]


def test_a_run_whose_data_is_gone_is_timed_on_random_input_and_says_why(runs, tmp_path):
    import yaml

    run = tmp_path / "moved"
    shutil.copytree(runs[0], run)
    recipe = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    recipe["data"].update(format="npz", path=str(tmp_path / "gone.npz"))
    (run / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe))
    result = invoke("bench", run, *FAST, "--batch", "2", "--runtime", "onnxruntime", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    timed_on = data["variants"][0]["timed_on"]
    assert timed_on.startswith("random values, shape [B,1,8,8] float32 (its recipe's data could not be loaded")
    assert all(r["p50_ms"] > 0 for r in data["results"])


def test_errors_in_json_mode_are_one_json_object(tmp_path):
    result = invoke("bench", tmp_path / "nope.onnx", "--json")
    assert result.exit_code == 2
    payload = json.loads(result.stdout.strip())
    assert payload["exit_code"] == 2 and "nope.onnx" in payload["error"]["message"] and payload["error"]["hint"]


def test_a_file_no_runtime_can_load_is_a_failure_not_a_missing_runtime(tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"\x08\x07not a protobuf model")
    result = invoke("bench", broken, *FAST, "--runtime", "onnxruntime")
    assert result.exit_code == 4, result.output
    assert "no artifact could be loaded" in result.output and "broken.onnx" in result.output


def _relu_onnx(path: Path, width: int = 256) -> Path:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_the_best_batch_under_a_p99_budget_is_the_fastest_that_fits_with_its_cost(tmp_path):
    """Issue 25, item 4: per artifact and runtime, the batch of highest throughput whose p99 is within the budget,
    its throughput per core and, from a price, its cost per million inferences; or why no batch fits."""
    model = _relu_onnx(tmp_path / "relu.onnx")
    args = ("bench", model, "--runtime", "onnxruntime", "--batch", "1,8,64", "--runs", "10", "--warmup", "1", "--json")
    out = json.loads(invoke(*args, "--p99-budget-ms", "1000", "--price-per-hour", "0.36").stdout)
    rows = [r for r in out["results"] if r["error"] is None]
    (best,) = out["under_budget"]
    fastest = max(rows, key=lambda r: r["throughput"])
    assert best["batch"] == fastest["batch"] and best["throughput"] == fastest["throughput"]
    assert best["throughput_per_core"] == pytest.approx(best["throughput"] / out["settings"]["threads"])
    share = 1 / out["host"]["cpu"]["usable_cpus"]  # one thread: the lane pays for one core of the machine, not all
    assert best["cost_per_million"] == pytest.approx(0.36 * share / (best["throughput"] * 3600) * 1e6)
    assert all(r["cost_per_million"] == pytest.approx(0.36 * share / (r["throughput"] * 3600) * 1e6) and r["cores"] == 1
               for r in rows)
    tight = json.loads(invoke(*args, "--p99-budget-ms", "1e-6").stdout)["under_budget"][0]
    assert tight["batch"] is None and "no batch size timed has p99 within 1e-06 ms" in tight["why"]
    assert invoke(*args, "--p99-budget-ms", "0").exit_code == 2


# --------------------------------------------------------------------------- curves, prices, hosts merged


def test_curves_turn_logarithmic_over_a_wide_span_and_ring_the_chosen_batch():
    from pruneflow.benchmark.curves import Axes, Series, line_chart

    narrow = [Series("a", "#1f77b4", "", [(1, 10.0), (8, 12.0), (64, 30.0)], ring=8)]
    wide = [Series("b", "#ff7f0e", "8 4", [(1, 0.3), (8, 2.0), (64, 60.0)])]
    linear, log = Axes.fit(narrow), Axes.fit(wide, rule=20.0)
    assert not linear.log_y and linear.y_lo == 0 and log.log_y and log.y_lo < 0.3 and log.y_hi > 60
    assert log.px(1) < log.px(8) < log.px(64) and log.px(8) - log.px(1) == pytest.approx(log.px(64) - log.px(8))
    assert log.py(60.0) < log.py(20.0) < log.py(0.3)  # up is more
    svg = line_chart(narrow + wide, Axes.shared([narrow, wide], 20.0), "p99 latency (ms)", rule=20.0, rule_label="budget")
    assert svg.count('r="10"') == 1 and "budget" in svg and 'stroke-dasharray="8 4"' in svg and ">0.3<" in svg
    assert "(log scale)" in svg


def _host_json(model: Path, out: Path, label: str, *extra: str) -> dict:
    result = invoke("bench", model, "--runtime", "onnxruntime", "--batch", "1,8,64", "--runs", "10", "--warmup", "1",
                    "--host-label", label, "--json", out, *extra)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_hosts_merged_side_by_side_with_a_price_table(tmp_path):
    """Issue 25, item 4: two hosts' bench JSON in one comparison: each priced from a table (label, then CPU model),
    the best batch under the budget per host, its cost per million; JSON, Prometheus and HTML curves."""
    model = _relu_onnx(tmp_path / "relu.onnx")
    a = _host_json(model, tmp_path / "a.json", "c7i.large", "--p99-budget-ms", "1000")
    assert a["host"]["label"] == "c7i.large"
    _host_json(model, tmp_path / "b.json", "spare box")
    cpu = a["host"]["cpu"]["model"]
    prices = tmp_path / "prices.yaml"
    prices.write_text(f"C7I.LARGE: 0.09\n'{cpu[:6]}': 0.5\n{cpu}: 0.25\n")  # the longest piece of the model wins
    files = ("--json", tmp_path / "m.json", "--html", tmp_path / "m.html", "--prometheus", tmp_path / "m.prom")
    result = invoke("bench", "--merge", tmp_path / "a.json", tmp_path / "b.json", "--price-per-hour", prices, *files)
    assert result.exit_code == 0, result.output
    merged = json.loads((tmp_path / "m.json").read_text(), parse_constant=_no_constants)
    assert merged["format"] == "pruneflow-bench-merge/1" and merged["p99_budget_ms"] == 1000  # as a.json was benched
    hosts = {h["name"]: h for h in merged["hosts"]}
    assert hosts["c7i.large"]["price_per_hour"] == 0.09 and hosts["spare box"]["price_per_hour"] == 0.25
    assert repr(cpu) in hosts["spare box"]["price_source"]
    for row in merged["results"]:
        price = hosts[row["host"]]["price_per_hour"] / hosts[row["host"]]["host"]["cpu"]["usable_cpus"]  # one core's share
        assert row["cost_per_million"] == pytest.approx(price / (row["throughput"] * 3600) * 1e6)
        assert row["throughput_per_core"] == pytest.approx(row["throughput"])  # 1 thread
    chosen = {e["host"]: e for e in merged["under_budget"]}
    for name in hosts:
        rows = [r for r in merged["results"] if r["host"] == name]
        assert chosen[name]["throughput"] == max(r["throughput"] for r in rows if r["p99_ms"] <= 1000)
    samples = parse_prometheus((tmp_path / "m.prom").read_text())
    assert {labels["host"] for _, labels, _ in samples} == set(hosts)
    assert {name for name, _, _ in samples} >= {"pruneflow_cost_per_million", "pruneflow_best_batch"}
    html = (tmp_path / "m.html").read_text()
    assert html.count("<svg") == 4 and "c7i.large: latency and throughput" in html and "cost / 1M" in html
    assert "c7i.large" in result.stdout and "best batch with p99 within 1000 ms" in result.stdout
    from pruneflow.benchmark.html import PALETTE

    pixels = screenshot(tmp_path / "m.html", tmp_path, height=1400)  # the one artifact's curves on both hosts
    assert int((pixels == tuple(int(PALETTE[0][k:k + 2], 16) for k in (1, 3, 5))).all(axis=1).sum()) >= 400


def test_price_and_merge_mistakes_exit_2_naming_the_file(tmp_path):
    model = _relu_onnx(tmp_path / "relu.onnx")
    args = ("bench", model, "--runtime", "onnxruntime", "--batch", "1", "--runs", "3", "--warmup", "0")
    bad = tmp_path / "prices.yaml"
    bad.write_text("c7i.large: free\n")
    other = tmp_path / "other.json"
    other.write_text('{"format": "pruneflow-run/1"}')
    cases = [((*args, "--price-per-hour", "-1"), "a price must be a positive number"),
             ((*args, "--price-per-hour", tmp_path / "nope.yaml"), "nope.yaml: neither a number nor a file"),
             ((*args, "--price-per-hour", bad), "the price of 'c7i.large' is 'free'"),
             (("bench", "--merge", other), "needs two or more"),
             (("bench", "--merge", other, other), "other.json: not a bench result")]
    for argv, message in cases:
        result = invoke(*argv)
        assert result.exit_code == 2 and message in result.output, (argv, result.output)
    bad.write_text("somewhere else: 1.0\n")  # a table without this host: no cost, and bench says why
    result = invoke(*args, "--price-per-hour", bad, "--json")
    out = json.loads(result.stdout)
    assert out["results"][0]["cost_per_million"] is None and "has no price for" in out["settings"]["price_source"]
