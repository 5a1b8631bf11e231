"""Issue 15's acceptance: every family of tests/families/ through the CLI, `optimize` with a recipe naming
the family by absolute path: train → prune (channels; heads first for the ViT) → calibrate → qat (fp16, int8)
→ export ONNX + OpenVINO fp32/int8, and ptq → export int8 on the same pruned model, with parity (cosine,
top-1 agreement against the quantized torch model) and accuracy measured in each runtime; and `doctor` on
each family's recipe. Data: the built-in digits, an npz of digits + a metadata vector (two_input), and
synthetic token data written here (lstm_text: the label is whether token 7 occurs, learnable in a few steps).

Every figure asserted comes from the run's own metrics.json (real NNCF, onnxruntime and OpenVINO runs).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import invoke, write

pytest.importorskip("nncf")
pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

FAMILIES = Path(__file__).resolve().parent / "families"
ZOO = ["vit", "convnext", "se_net", "mobilenet_se", "densenet", "lstm_text", "two_input"]
KWARGS: dict[str, dict] = {"vit": {"dim": 32, "heads": 4}, "lstm_text": {"vocab_size": 64, "embed_dim": 16, "hidden": 16}}


def _data(name: str, folder: Path) -> dict:
    """The recipe's data section for a family; npz files are written into ``folder``."""
    if name == "two_input":
        from sklearn.datasets import load_digits

        digits = load_digits()
        rng = np.random.default_rng(0)
        meta = (np.eye(4)[digits.target % 4] + 0.3 * rng.standard_normal((len(digits.target), 4))).astype(np.float32)
        np.savez(folder / "two.npz", pixels=(digits.images / 16).astype(np.float32), features=meta, label=digits.target)
        return {"format": "npz", "path": str(folder / "two.npz"), "input_column": {"image": "pixels", "meta": "features"},
                "max_train_samples": 1300, "max_eval_samples": 200}
    if name == "lstm_text":
        rng = np.random.default_rng(0)
        rows, width = 700, 12
        lengths = rng.integers(3, width + 1, rows)
        mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int64)
        ids = rng.integers(8, 64, (rows, width)) * mask
        label = rng.integers(0, 2, rows)
        where = rng.integers(0, lengths)  # class 1: token 7 somewhere in the real tokens
        ids[np.arange(rows)[label == 1], where[label == 1]] = 7
        np.savez(folder / "text.npz", input_ids=ids, attention_mask=mask, label=label)
        return {"format": "npz", "path": str(folder / "text.npz"),
                "input_column": {"input_ids": "input_ids", "attention_mask": "attention_mask"},
                "max_train_samples": 500, "max_eval_samples": 200}
    return {"format": "digits", "max_train_samples": 1300, "max_eval_samples": 200}


def _stages(name: str) -> list[dict]:
    lr = {"lr": 0.003, "optimizer": "adamw"} if name in ("vit", "convnext", "lstm_text") else {"lr": 0.05}
    prune = [{"type": "prune", "name": "prune", "target": {"macs": 0.7}, "rounds": 1, "latency": None,
              "finetune": {"epochs": 1, **lr}}]
    if name == "vit":
        prune.insert(0, {"type": "prune", "name": "heads", "target": {"heads": 0.5}, "rounds": 1, "importance": "taylor",
                         "latency": None, "finetune": {"epochs": 1, **lr}})
    return [
        {"type": "train", "epochs": 6 if name == "vit" else 3, "batch_size": 32, **lr},
        *prune,
        {"type": "calibrate", "size": 128},
        {"type": "qat", "schedule": [{"precision": "fp16", "epochs": 1}, {"precision": "int8", "epochs": 1}],
         "finetune": {**lr, "lr": lr["lr"] / 10}},
        {**EXPORT, "precisions": ["fp32", "int8"]},
    ]


EXPORT = {"type": "export", "targets": ["onnx", "openvino"], "latency": None, "parity": {"samples": 200}}
PTQ = [{"type": "calibrate", "size": 128}, {"type": "ptq"}, {**EXPORT, "precisions": ["int8"]}]


def zoo_recipe(name: str, folder: Path, stages: list[dict] | None = None, checkpoint: Path | None = None) -> Path:
    """FOLDER/<name>.yaml: the family by absolute path, its data, ``stages`` (default: the qat run)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = {"factory": f"{FAMILIES / name}.py:build", "kwargs": KWARGS.get(name, {})}
    if checkpoint is not None:
        model["checkpoint"] = str(checkpoint)
    return write(folder / f"{name}{'-ptq' if checkpoint else ''}.yaml", {
        "name": name, "seed": 0, "device": "cpu", "model": model,
        "data": _data(name, folder),
        "stages": _stages(name) if stages is None else stages,
    })
