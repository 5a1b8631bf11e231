"""One runtime layer: load any artifact behind one interface, run it, time several interleaved.

Used by the export stage's checks, evaluation and `pruneflow bench`::

    from pruneflow.runtime import open_artifact, time_interleaved, host_info

    fp32 = open_artifact("export/onnx/model.fp32.onnx")                 # onnxruntime, best provider
    ir = open_artifact("export/openvino/model.int8.xml", device="CPU")  # OpenVINO
    stats = time_interleaved({"fp32": fp32, "int8": ir}, batch, warmup=3, runs=50)
    stats["int8"].p50_ms, host_info()["cpu"]["model"]

A service embeds :class:`Server` (``serving.py``): one artifact on a device behind a dynamic batcher, with live
Prometheus metrics (``metrics.py``).

An absent runtime or device raises ``RuntimeUnavailable`` (exit 3) naming what is missing; nothing is
ever run on a substitute and reported as the one asked for.
"""

from __future__ import annotations

from .base import Executor, RuntimeUnavailable
from .executor import open_artifact, runtimes_for
from .host import host_info, timing_host
from .serving import BatchPolicy, Server, ServerClosed, ServingConfig
from .timing import LatencyStats, fresh_batch, interleaved_times, time_interleaved

__all__ = ["BatchPolicy", "Executor", "Server", "ServerClosed", "ServingConfig", "LatencyStats", "RuntimeUnavailable", "fresh_batch", "host_info", "timing_host", "interleaved_times", "open_artifact",
           "runtimes_for", "time_interleaved"]
