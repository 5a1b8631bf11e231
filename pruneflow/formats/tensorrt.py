"""TensorRT engine (``.engine``, ``.plan``): a serialized plan for one GPU and TensorRT version, run by TensorRT on
CUDA. Its deployment record lives beside it in the bundle (the engine file holds none)."""

from __future__ import annotations

from .base import Format


class EngineFormat(Format):
    name = "tensorrt"
    title = "TensorRT engine"
    suffixes = (".engine", ".plan")
    runtimes = ("tensorrt",)
