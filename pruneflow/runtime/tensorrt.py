"""A TensorRT engine behind the runtime layer's interface (TensorRT 10/11 Python API, I/O through torch CUDA
tensors). Used only where ``tensorrt`` imports and torch sees a CUDA device; elsewhere RuntimeUnavailable.

The calls are TensorRT 10's name-based tensor API, unchanged in 11: ``Runtime.deserialize_cuda_engine``,
``create_execution_context``, ``num_io_tensors``/``get_tensor_name``/``get_tensor_mode``, ``set_input_shape``,
``get_tensor_shape``, ``set_tensor_address`` and ``execute_async_v3`` on a torch CUDA stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .base import Executor, Feed, RuntimeUnavailable, feed_for, joined


def load_engine(path: Path, device: str | None = None) -> Executor:
    """``path`` (a serialized engine) on CUDA device ``device`` (``cuda`` or ``cuda:N``; default the current one)."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise RuntimeUnavailable(f"{path.name} is a TensorRT engine and TensorRT is not installed here",
                                 hint="run it on the machine it was built for (same TensorRT version and GPU)") from exc
    import torch

    if not torch.cuda.is_available():
        raise RuntimeUnavailable(f"{path.name} is a TensorRT engine and torch sees no CUDA device here",
                                 hint="run it on a machine with the GPU it was built for")
    if device and not device.lower().startswith("cuda"):
        raise RuntimeUnavailable(f"a TensorRT engine runs on a CUDA device, not {device!r}", hint="use device cuda or cuda:N")
    torch_device = torch.device(device.lower() if device else "cuda")
    session = TrtSession(trt, path.read_bytes(), torch_device, torch.cuda.Stream(torch_device))
    return Executor(path, "tensorrt", str(torch_device).upper(), session,
                    {"version": trt.__version__, "gpu": torch.cuda.get_device_name(torch_device),
                     "inputs": session.inputs, "outputs": session.outputs})


class TrtSession:
    """One engine and one execution context; ``session(x)`` copies ``x`` to the GPU, runs, returns the first
    output on the host. ``stream`` is a torch CUDA stream (anything with ``cuda_stream`` and ``synchronize``)."""

    def __init__(self, trt: Any, engine_bytes: bytes, device: Any, stream: Any):
        self.trt, self.device, self.stream = trt, device, stream
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            raise RuntimeUnavailable("TensorRT could not deserialize the engine (built by another TensorRT version or for another GPU?)",
                                     hint="rebuild the engine on this machine with its build_engine.py")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]

    def max_batch(self) -> int | None:
        """The largest batch the engine's optimisation profile 0 takes (None where the API cannot say)."""
        shapes = getattr(self.engine, "get_tensor_profile_shape", None)
        if shapes is None:
            return None
        return min(int(shapes(name, 0)[2][0]) for name in self.inputs)

    def __call__(self, x: "Feed") -> np.ndarray:
        """``x`` in slices of at most the profile's largest batch; a text feed's slices cut to their longest
        row (dynamic padding), so rows padded to ``data.max_length`` fit the profile's sequence range."""
        feed = feed_for(x, self.inputs)
        return in_batches(self._run, feed, self.max_batch() or len(next(iter(feed.values()))))

    def _run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        import torch

        trt = self.trt
        kept = []  # the device copies must live until the run ends
        for name, array in feed.items():
            dtype = _torch_dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            tensor = torch.from_numpy(array).to(self.device, dtype=dtype)
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
            kept.append(tensor)
        outputs = {}
        for out in self.outputs:
            shape = tuple(self.context.get_tensor_shape(out))
            out_dtype = _torch_dtype(trt.nptype(self.engine.get_tensor_dtype(out)))
            outputs[out] = torch.empty(shape, dtype=out_dtype, device=self.device)
            self.context.set_tensor_address(out, outputs[out].data_ptr())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed (see TensorRT's log above)")
        self.stream.synchronize()
        return joined([outputs[name].float().cpu().numpy() for name in self.outputs])


def _torch_dtype(np_dtype: Any) -> Any:
    import torch

    return torch.from_numpy(np.zeros(1, dtype=np_dtype)).dtype


def in_batches(run: Any, x: Any, limit: int) -> np.ndarray:
    """Run ``x`` (an array, or a feed of named arrays) in slices of at most ``limit`` samples; a text feed's
    slices are cut to their longest row (``trim_tokens``)."""
    if not isinstance(x, dict):
        return np.concatenate([np.asarray(run(x[i : i + limit])) for i in range(0, len(x), limit)])
    rows = len(next(iter(x.values())))
    return np.concatenate([np.asarray(run(trim_tokens({k: v[i : i + limit] for k, v in x.items()})))
                           for i in range(0, rows, limit)])


def trim_tokens(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Token arrays (2-D integers) cut to the longest row of the attention mask, when there is one
    (``pruneflow.inputs.trim`` for numpy feeds)."""
    mask = feed.get("attention_mask")
    if mask is None or mask.ndim != 2 or not len(mask):
        return feed
    width = max(int(mask.sum(1).max()), 1)
    return {k: np.ascontiguousarray(v[:, :width]) if v.ndim == 2 and v.dtype.kind in "iu" else v for k, v in feed.items()}
