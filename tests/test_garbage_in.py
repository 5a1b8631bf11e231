"""Garbage in must never give exit 0, nor an internal error (issue 14): bad data, weights, shapes, names, seeds,
--out folders and arguments, through the real CLI.

Each catalogue entry builds its files in tmp_path and returns a :class:`Case`: the command line, the texts
the error must show (what is wrong, where: file, column, key, and the fix) and the exit code. Every case is
refused before anything is trained or written: no run folder, no lock file; one test shows an earlier run
in the same folder is left as it was. Recipe-only cases also fail `validate` and `optimize --dry-run`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pruneflow.zoo import ZOO
from conftest import invoke, tiny_train_recipe as tiny, write



def tiny_text(**changes) -> str:
    """The recipe as YAML written by hand where yaml.safe_dump would not write a value as YAML reads it (.nan)."""
    return json.dumps(tiny(**changes)).replace("NaN", ".nan")


def snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass
class Case:
    recipe: Path
    shows: list[str]  # what, where (file / column / key) and the fix, each must appear in the error
    out: Path | None = None  # default: RECIPE's folder / runs
    recipe_only: bool = False  # the recipe alone shows it: validate and --dry-run refuse it too
    bad_out: bool = False  # --out is the problem: --dry-run refuses it too
    extra: list[str] = field(default_factory=list)


def digits_npz(path: Path, n: int = 60, classes: int = 10, **arrays) -> Path:
    rng = np.random.default_rng(0)
    data = {"x": rng.random((n, 8, 8), dtype=np.float32), "y": np.arange(n) % classes, **arrays}
    np.savez(path, **data)
    return path


def float_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return ZOO["digits_cnn"].factory(width=8).state_dict()


def first_float_key(state: dict[str, torch.Tensor]) -> str:
    return next(k for k, v in state.items() if v.is_floating_point())


# --------------------------------------------------------------------------- the catalogue


def nan_in_npz_inputs(tmp: Path) -> Case:
    x = np.random.default_rng(0).random((60, 8, 8), dtype=np.float32)
    x[3, 2, 2], x[17, 0, 0] = np.nan, np.inf
    digits_npz(tmp / "data.npz", x=x)
    recipe = write(tmp / "r.yaml", tiny(data={"format": "npz", "path": "data.npz", "label_column": "y"}))
    return Case(recipe, ["data.npz", "column 'x'", "2 of", "NaN or infinite", "rows 3, 17", "Fix:", "nan_to_num"])


def inf_in_csv_inputs(tmp: Path) -> Case:
    rows = ["f0,f1,f2,f3,label"] + [f"{i % 5}.5,1.0,{'inf' if i == 7 else '2.0'},0.5,{i % 3}" for i in range(30)]
    write(tmp / "data.csv", "\n".join(rows) + "\n")
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "torch.nn:Linear", "kwargs": {"in_features": 4, "out_features": 3}},
                                        trust={"code": ["torch.nn:Linear"]}, data={"format": "csv", "path": "data.csv"}))
    return Case(recipe, ["data.csv", "column 'f2'", "1 of 30 samples", "NaN or infinite", "rows 7", "Fix:"])


def nan_weights(tmp: Path) -> Case:
    state = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in float_state().items()}
    torch.save(state, tmp / "weights.pt")
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "digits_cnn", "kwargs": {"width": 8}, "checkpoint": "weights.pt"}))
    key = first_float_key(state)
    return Case(recipe, ["model.checkpoint", "weights.pt", "NaN or infinite", key, "Fix:", "before the loss"])


def _cast_checkpoint(tmp: Path, dtype: torch.dtype, name: str) -> Case:
    state = {k: (v * 100).to(dtype) if v.is_floating_point() else v for k, v in float_state().items()}
    save_file(state, str(tmp / "weights.safetensors"))
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "digits_cnn", "kwargs": {"width": 8},
                                               "checkpoint": "weights.safetensors"}))
    key = first_float_key(float_state())
    return Case(recipe, ["model.checkpoint", "weights.safetensors", f"{key} is {name} where the model's is float32",
                         "cast them silently", "Fix:", "keeps its dtype"])


def int32_safetensors(tmp: Path) -> Case:
    return _cast_checkpoint(tmp, torch.int32, "int32")


def bool_safetensors(tmp: Path) -> Case:
    return _cast_checkpoint(tmp, torch.bool, "bool")


def std_zero(tmp: Path) -> Case:
    recipe = write(tmp / "r.yaml", tiny(data={"format": "digits", "mean": [0.5], "std": [0]}))
    return Case(recipe, ["r.yaml:", "data.std", "[0]", "must be a number > 0", "Fix:"], recipe_only=True)


def a_zero_in_the_std_list(tmp: Path) -> Case:
    digits_npz(tmp / "data.npz")
    recipe = write(tmp / "r.yaml", tiny(data={"format": "npz", "path": "data.npz", "label_column": "y",
                                              "mean": [0.5, 0.5, 0.5], "std": [0.2, 0.0, 0.2]}))
    return Case(recipe, ["r.yaml:", "data.std", "[0.2, 0.0, 0.2]", "must be a number > 0", "Fix:"], recipe_only=True)


def a_nan_std(tmp: Path) -> Case:
    recipe = write(tmp / "r.yaml", tiny_text(data={"format": "digits", "mean": [0.5], "std": [float("nan")]}))
    return Case(recipe, ["r.yaml:", "data.std", "must be a number > 0", "Fix:"], recipe_only=True)


def nan_in_a_separate_train_file(tmp: Path) -> Case:
    x = np.random.default_rng(0).random((40, 8, 8), dtype=np.float32)
    x[39] = np.nan
    digits_npz(tmp / "train.npz", n=40, x=x)
    digits_npz(tmp / "eval.npz", n=20)
    recipe = write(tmp / "r.yaml", tiny(data={"format": "npz", "train": "train.npz", "eval": "eval.npz", "label_column": "y"}))
    return Case(recipe, ["train.npz", "column 'x'", "1 of 40 samples", "rows 39", "Fix:"])


NAN_FACTORY = """
import torch
from pruneflow.zoo import ZOO

def make():
    model = ZOO["digits_cnn"].factory(width=8)
    with torch.no_grad():
        model.classifier.weight.fill_(float("nan"))
    return model
"""


def a_factory_whose_model_gives_nan(tmp: Path) -> Case:
    write(tmp / "nan_model.py", NAN_FACTORY)
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "nan_model.py:make"}))
    return Case(recipe, ["nan_model.py:make", "gives NaN or infinite outputs on the first 8 eval samples", "Fix:"])


def input_shape_not_the_datas(tmp: Path) -> Case:
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "digits_cnn", "kwargs": {"width": 8}, "input_shape": [1, 16, 16]}))
    return Case(recipe, ["r.yaml:", "model.input_shape", "[1, 16, 16]", "the data's samples are [1, 8, 8]",
                         "Fix: set model.input_shape: [1, 8, 8]"])


def zoo_shape_not_the_datas(tmp: Path) -> Case:
    """resnet20 runs on 8x8 inputs (adaptive pooling): without the check its MACs were reported for 32x32."""
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "resnet20", "kwargs": {"num_classes": 10}}))
    return Case(recipe, ["model.input_shape", "zoo model's default input shape is [3, 32, 32]",
                         "the data's samples are [1, 8, 8]", "Fix:"])


def model_fails_on_the_data(tmp: Path) -> Case:
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "torch.nn:Linear", "kwargs": {"in_features": 10, "out_features": 10},
                                               "input_shape": [1, 8, 8]}, trust={"code": ["torch.nn:Linear"]}))
    return Case(recipe, ["torch.nn:Linear", "fails on a batch of the data, shape (8, 1, 8, 8)", "Fix:", "model.kwargs"])


def labels_beyond_the_class_names(tmp: Path) -> Case:
    digits_npz(tmp / "data.npz", class_names=np.array(["zero", "one", "two"]))
    recipe = write(tmp / "r.yaml", tiny(data={"format": "npz", "path": "data.npz", "label_column": "y"}))
    return Case(recipe, ["data.label_column 'y'", "has label 9", "the data gives 3 class names (ids 0..2)",
                         "Fix:", "one class name per label id"])


def more_classes_than_the_model_outputs(tmp: Path) -> Case:
    digits_npz(tmp / "data.npz", n=72, classes=12)
    recipe = write(tmp / "r.yaml", tiny(data={"format": "npz", "path": "data.npz", "label_column": "y"}))
    return Case(recipe, ["digits_cnn", "gives 10 outputs a sample but the data has 12 classes", "Fix:", "num_classes"])


def a_one_sample_dataset_leaves_no_training_split(tmp: Path) -> Case:
    digits_npz(tmp / "data.npz", n=1)
    recipe = write(tmp / "r.yaml", tiny(data={"format": "npz", "path": "data.npz", "label_column": "y"}))
    return Case(recipe, ["r.yaml:", "data.eval_fraction", "1 sample(s)", "leave 0 for training", "Fix:"])


def an_empty_eval_file(tmp: Path) -> Case:
    digits_npz(tmp / "train.npz")
    recipe = write(tmp / "r.yaml", tiny(data={"format": "npz", "train": "train.npz", "eval": "eval.npz"}))
    np.savez(tmp / "eval.npz", x=np.zeros((0, 8, 8), dtype=np.float32), y=np.zeros((0,), dtype=np.int64))
    return Case(recipe, ["data.eval", "eval.npz", "holds no rows", "Fix:"])


def a_huge_seed(tmp: Path) -> Case:
    recipe = write(tmp / "r.yaml", tiny(seed=2**40))
    return Case(recipe, ["r.yaml:", "seed", str(2**40), "less than or equal to 4294967295", "Fix:"], recipe_only=True)


def a_300_character_recipe_name(tmp: Path) -> Case:
    recipe = write(tmp / "r.yaml", tiny(name="n" * 300))
    return Case(recipe, ["r.yaml:", "  name  ", "at most 100 characters", "Fix:"], recipe_only=True)


def a_300_character_stage_name(tmp: Path) -> Case:
    recipe = write(tmp / "r.yaml", tiny(stages=[{"type": "evaluate", "name": "s" * 300}]))
    return Case(recipe, ["r.yaml:", "stages.0.name", "at most 100 characters", "Fix:"], recipe_only=True)


def an_out_that_is_a_file(tmp: Path) -> Case:
    recipe = write(tmp / "r.yaml", tiny())
    return Case(recipe, ["--out", "is a file, not a folder", "Fix: choose an --out folder"], out=write(tmp / "runs", "a file"), bad_out=True)


def an_out_on_a_read_only_file_system(tmp: Path) -> Case:
    """/sys refuses new files to everyone, root included (a chmod 555 folder does not stop root)."""
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no /sys here")
    recipe = write(tmp / "r.yaml", tiny())
    return Case(recipe, ["--out /sys/pruneflow-runs", "cannot write in /sys", "nothing was written", "Fix:"],
                out=Path("/sys/pruneflow-runs"), bad_out=True)


def an_out_in_a_read_only_folder(tmp: Path) -> Case:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder; the /sys case covers root")
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    recipe = write(tmp / "r.yaml", tiny())
    return Case(recipe, [f"cannot write in {locked}", "Fix:"], out=locked / "runs", bad_out=True)


def text_in_a_csv_column_of_numbers(tmp: Path) -> Case:
    """A column of numbers with one word in it reads as text: it was left out of the inputs silently (the model then
    failed on the shape), or, named in input_column, a traceback (`could not convert string to float`; issue 41)."""
    rows = ["f0,f1,f2,f3,label"] + [f"{i % 5}.5,{'twelve' if i == 7 else '1.0'},2.0,0.5,{i % 3}" for i in range(30)]
    write(tmp / "data.csv", "\n".join(rows) + "\n")
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "mlp", "kwargs": {"in_features": 4, "out_features": 3}},
                                        data={"format": "csv", "path": "data.csv"}))
    return Case(recipe, ["data.csv", "column 'f1' holds text where the model's inputs are numbers", "row 7: 'twelve'", "Fix:"])


def text_in_a_parquet_input_column(tmp: Path) -> Case:
    import pandas as pd

    pd.DataFrame({"f0": np.arange(30.0), "f1": [f"w{i}" for i in range(30)], "label": np.arange(30) % 3}).to_parquet(tmp / "d.parquet")
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "mlp", "kwargs": {"in_features": 2, "out_features": 3}},
                                        data={"format": "parquet", "path": "d.parquet", "input_column": ["f0", "f1"]}))
    return Case(recipe, ["d.parquet", "column 'f1' holds text", "30 of 30 rows", "data.features.categorical"])


def a_blank_label_in_a_csv(tmp: Path) -> Case:
    """NaN labels were reported as a dtype problem ("must hold integer class ids (found float32)"; issue 41)."""
    rows = ["f0,f1,label"] + [f"{i % 5}.5,1.0,{'' if i in (4, 9) else i % 3}" for i in range(30)]
    write(tmp / "data.csv", "\n".join(rows) + "\n")
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "mlp", "kwargs": {"in_features": 2, "out_features": 3}},
                                        data={"format": "csv", "path": "data.csv"}))
    return Case(recipe, ["data.csv", "the label column 'label' is empty or NaN in 2 of 30 rows (rows 4, 9", "Fix:"])


def a_nan_label_in_a_parquet_file(tmp: Path) -> Case:
    import pandas as pd

    label = np.where(np.arange(30) == 3, np.nan, np.arange(30) % 3)
    pd.DataFrame({"f0": np.arange(30.0), "f1": np.ones(30), "label": label}).to_parquet(tmp / "d.parquet")
    recipe = write(tmp / "r.yaml", tiny(model={"factory": "mlp", "kwargs": {"in_features": 2, "out_features": 3}},
                                        data={"format": "parquet", "path": "d.parquet"}))
    return Case(recipe, ["d.parquet", "'label' is empty or NaN in 1 of 30 rows (rows 3"])


CATALOGUE: dict[str, Callable[[Path], Case]] = {f.__name__: f for f in [
    text_in_a_csv_column_of_numbers, text_in_a_parquet_input_column, a_blank_label_in_a_csv, a_nan_label_in_a_parquet_file,
    nan_in_npz_inputs, inf_in_csv_inputs, nan_weights, int32_safetensors, bool_safetensors, std_zero,
    a_zero_in_the_std_list, input_shape_not_the_datas, zoo_shape_not_the_datas, model_fails_on_the_data,
    labels_beyond_the_class_names, more_classes_than_the_model_outputs, a_one_sample_dataset_leaves_no_training_split,
    an_empty_eval_file, a_huge_seed, a_300_character_recipe_name, a_300_character_stage_name, an_out_that_is_a_file,
    an_out_on_a_read_only_file_system, an_out_in_a_read_only_folder,
]}


def assert_refused(result, shows: list[str], code: int = 2) -> None:
    assert result.exit_code == code, result.output
    for text in shows:
        assert text in result.stderr, f"{text!r} not in:\n{result.stderr}"
    assert "internal error" not in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_garbage_in_is_refused_before_anything_is_written(tmp_path, name):
    case = CATALOGUE[name](tmp_path)
    out = case.out or tmp_path / "runs"
    before = out.read_bytes() if out.is_file() else None
    result = invoke("optimize", case.recipe, "--out", out, "--json", *case.extra)
    assert_refused(result, case.shows)
    payload = json.loads(result.stdout)
    assert payload["exit_code"] == 2 and payload["error"]["hint"]
    # nothing written: no run folder, no lock file beside it, the --out file untouched
    assert not (out / "tiny").exists() and not (out / ".tiny.lock").exists()
    assert (out.read_bytes() if out.is_file() else None) == before
    assert not out.exists() or out.is_file() or not any(out.iterdir())
    commands = [["validate", case.recipe], ["optimize", case.recipe, "--out", out, "--dry-run"]]
    if case.recipe_only:
        for command in commands:
            assert_refused(invoke(*command), case.shows)
    elif case.bad_out:
        assert_refused(invoke(*commands[1]), case.shows)  # --dry-run checks --out as well


@pytest.mark.slow
def test_an_earlier_run_in_the_folder_is_left_as_it_was(tmp_path):
    """Garbage in is refused before the run folder is replaced: the last good run stays whole."""
    recipe = write(tmp_path / "r.yaml", tiny(stages=[{"type": "evaluate"}]))
    assert invoke("optimize", recipe, "--out", tmp_path / "runs").exit_code == 0
    before = snapshot(tmp_path / "runs")
    case = nan_in_npz_inputs(tmp_path)
    assert_refused(invoke("optimize", case.recipe, "--out", tmp_path / "runs"), case.shows)
    assert snapshot(tmp_path / "runs") == before
    assert json.loads((tmp_path / "runs" / "tiny" / "manifest.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("shape, shows", [
    ("0,8,8", "every dimension must be at least 1 (got [0, 8, 8])"),
    ("-1,8,8", "every dimension must be at least 1 (got [-1, 8, 8])"),
    ("1000000000", "one sample would hold 1,000,000,000 values, more than the 134,217,728 allowed"),
    ("3,65536,65536", "one sample would hold 12,884,901,888 values"),
    ("3,x", "is not a list of integers"),
])
def test_inspect_refuses_an_input_shape_out_of_range(shape, shows):
    result = invoke("inspect", "digits_cnn", "--input-shape", shape)
    assert_refused(result, ["--input-shape", shows, "Fix:"])
    as_json = invoke("inspect", "digits_cnn", "--input-shape", shape, "--json")
    assert json.loads(as_json.stdout)["exit_code"] == 2


def test_a_recipe_input_shape_out_of_range_is_refused_by_validate(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny(model={"factory": "digits_cnn", "input_shape": [1, 0, 8]}))
    assert_refused(invoke("validate", recipe), ["r.yaml:", "model.input_shape", "[1, 0, 8]",
                                                "every dimension must be at least 1"])


def test_calibrate_refuses_a_seed_numpy_cannot_take(tmp_path):
    digits_npz(tmp_path / "data.npz")
    result = invoke("calibrate", tmp_path / "data.npz", "--out", tmp_path / "calib", "--seed", str(2**40))
    assert result.exit_code == 2 and "--seed" in result.output and "4294967295" in result.output
    assert not (tmp_path / "calib").exists()


@pytest.mark.slow
def test_disk_full_while_writing_a_checkpoint_leaves_no_half_written_file(tmp_path, monkeypatch):
    """ENOSPC raised by the atomic writer once some bytes landed: exit 4 naming the file, no model.pt nor its
    temporary, the manifest `failed`, and --resume continues once there is space."""
    from pruneflow import artifacts, checkpoint

    real = artifacts.atomic_path

    @contextlib.contextmanager
    def full_disk(final):
        with real(final) as tmp:
            tmp.write_bytes(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        yield tmp  # never reached

    monkeypatch.setattr(checkpoint, "atomic_path", full_disk)
    recipe = write(tmp_path / "r.yaml", tiny())
    run_dir = tmp_path / "runs" / "tiny"
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert_refused(result, [f"disk full at {run_dir / 'stages' / '01-train' / 'model.pt'}", "No space left on device",
                            "nothing half-written", "Fix: free space", "--resume"], code=4)
    assert json.loads(result.stdout)["error"]["type"] == "StageError"
    assert not (run_dir / "stages" / "01-train" / "model.pt").exists()
    assert not list(run_dir.rglob("*.tmp"))
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "failed"
    monkeypatch.setattr(checkpoint, "atomic_path", real)
    again = invoke("optimize", recipe, "--out", tmp_path / "runs", "--resume")
    assert again.exit_code == 0, again.output


def test_a_run_checkpoint_with_tensors_of_another_kind_is_refused_naming_the_key(tmp_path):
    """The run-folder path (inspect, --resume): reshaping took the file's dtype, so int32 weights became int32
    parameters; now refused before any copy is made."""
    from pruneflow.checkpoint import FORMAT, checkpoint_bytes, describe_structure, load_checkpoint
    from pruneflow.errors import InputError

    model = ZOO["digits_cnn"].factory(width=8)
    state = {k: v.to(torch.int32) if k == "classifier.weight" else v for k, v in model.state_dict().items()}
    path = tmp_path / "model.pt"
    path.write_bytes(checkpoint_bytes({"format": FORMAT, "kind": "float", "structure": describe_structure(model),
                                       "state_dict": state, "meta": {}, "kind_payload": {}}))
    with pytest.raises(InputError) as caught:
        load_checkpoint(path, into=model)
    assert str(path) in caught.value.message and "classifier.weight is int32 where the model's is float32" in caught.value.message
    assert "re-run the stage" in (caught.value.hint or "")


def test_checkpoint_tensors_of_the_same_kind_load():
    """float16 weights for a float32 model, and int64 counters, are the same kind: accepted (and cast as torch does)."""
    from pruneflow.preflight import check_dtypes, dtype_class

    model = ZOO["digits_cnn"].factory(width=8)
    state = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    check_dtypes(model.state_dict(), state, "weights.pt")
    kinds = [dtype_class(d) for d in (torch.bfloat16, torch.uint8, torch.bool, torch.complex64)]
    assert kinds == ["float", "integer", "bool", "complex"]


def test_init_into_proc_is_a_one_paragraph_error(tmp_path):
    """`init quickstart /proc` was a traceback (FileNotFoundError from the temporary file; issue 41)."""
    for target in ("/proc", "/proc/recipe.yaml"):
        result = invoke("init", "quickstart", target)
        assert_refused(result, ["cannot write /proc/", "a file cannot be created in /proc", "nothing was written", "Fix:"])


def test_an_empty_onnx_file_is_named_by_inspect_and_bench(tmp_path):
    """An empty .onnx was an IndexError traceback in `inspect`, and exit 4 in `bench` (issue 41)."""
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    assert_refused(invoke("inspect", empty), [f"{empty} holds no ONNX graph (0 bytes", "Fix:"])
    assert_refused(invoke("bench", empty, "--runs", "1"), [f"{empty} is empty (0 bytes)", "Fix:"])


def test_a_5000_byte_out_is_a_one_paragraph_error(tmp_path):
    """A --out of 5,000 bytes in short folder names was a traceback (OSError: File name too long; issue 41)."""
    recipe = write(tmp_path / "r.yaml", tiny())
    out = tmp_path.joinpath(*["abcdefghij"] * 460)
    for extra in ((), ("--dry-run",)):
        result = invoke("optimize", recipe, "--out", out, *extra)
        assert_refused(result, ["bytes a path may have", "(File name too long); nothing was written", "choose a shorter --out"])
        assert len(result.stderr) < 1000  # the path is cut in the message, not printed whole
    assert not (tmp_path / "abcdefghij").exists()
