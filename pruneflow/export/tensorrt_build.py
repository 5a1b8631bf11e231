"""Build a TensorRT engine from an ONNX model: strongly typed, one optimisation profile, a timing cache.

pruneflow runs this code in-process where TensorRT imports and a CUDA GPU exists. Everywhere else it
copies this file, byte for byte, into the prepared bundle as ``build_engine.py``, so the machine with
the GPU runs the very same build code::

    python build_engine.py --onnx model.int8.tensorrt.onnx --engine model.int8.engine --min 1 --opt 8 --max 32

A text model's (batch, sequence) inputs (input_ids, attention_mask, token_type_ids) also take the
sequence range, ``--min-seq 8 --opt-seq 64 --max-seq 128``, in the same single profile.

Strongly typed (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``): the precision comes from the ONNX
itself (Q/DQ for int8, float16 tensors for fp16), never from builder flags, which TensorRT 11 removed.
On TensorRT 11 strong typing is always on and the flag is accepted and ignored.

Standalone on purpose: the standard library and ``tensorrt`` only (no pruneflow, no torch).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

FORMAT = "pruneflow-tensorrt-engine/1"
INSTALL_HINT = ("TensorRT is not installed: pip install tensorrt on the machine with the NVIDIA GPU "
                "(TensorRT needs CUDA even to parse an ONNX model), then run this script there; "
                "or use the trtexec commands in build.sh")


class BuildError(RuntimeError):
    """TensorRT refused the model; the message quotes TensorRT's own errors."""


class TensorRtMissing(BuildError):
    """``import tensorrt`` failed on this machine."""


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, or TensorRtMissing with the install hint.

    Any exception counts: the PyPI placeholder packages raise their own errors on import.
    """
    try:
        import tensorrt
    except Exception as exc:  # noqa: BLE001
        raise TensorRtMissing(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from exc
    return tensorrt


def network_flags(trt: Any) -> int:
    """``create_network`` flags: strongly typed (TensorRT 10's explicit choice, TensorRT 11's only mode)."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def batch_shapes(shape: tuple[int, ...], name: str, min_batch: int, opt_batch: int, max_batch: int) -> dict[str, tuple[int, ...]]:
    """The profile's min/opt/max shapes for an input whose first dimension is the batch."""
    return profile_shapes(shape, name, (min_batch, opt_batch, max_batch), None)


def profile_shapes(shape: tuple[int, ...], name: str, batch: tuple[int, int, int],
                   sequence: tuple[int, int, int] | None) -> dict[str, tuple[int, ...]]:
    """The profile's min/opt/max shapes for one input: its dynamic first dimension takes ``batch``, and the
    dynamic second dimension of a (batch, sequence) input (token ids, masks) takes ``sequence``."""
    for what, (lo, opt, hi) in (("batch", batch), ("sequence", sequence or (1, 1, 1))):
        if not lo <= opt <= hi:
            raise BuildError(f"the {what} range of the profile needs min <= opt <= max, got {lo}, {opt}, {hi}")
    seq_axis = len(shape) == 2 and shape[1] < 0
    if seq_axis and sequence is None:
        raise BuildError(f"input {name!r} has a dynamic sequence axis {list(shape)}: give the profile a sequence range "
                         "(--min-seq/--opt-seq/--max-seq)")
    rest = tuple(shape[2:] if seq_axis else shape[1:])
    if any(d < 0 for d in rest):
        raise BuildError(f"input {name!r} has dynamic dimensions besides the batch{' and sequence' if seq_axis else ''}: "
                         f"{list(shape)}; export the ONNX with a fixed input size")
    if shape[0] >= 0 and tuple(batch) != (shape[0],) * 3:
        raise BuildError(f"input {name!r} has a static batch of {shape[0]}: min, opt and max must all be {shape[0]}")
    out = {}
    for i, key in enumerate(("min", "opt", "max")):
        middle = (sequence[i],) if seq_axis and sequence is not None else ()
        out[key] = (batch[i], *middle, *rest)
    return out


def query_gpu() -> dict[str, str]:
    """Name and compute capability of GPU 0 from nvidia-smi (``unknown`` where it cannot say)."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.strip().splitlines()[0]
        name, capability = (part.strip() for part in line.rsplit(",", 1))
        return {"name": name, "compute_capability": capability}
    except Exception:  # noqa: BLE001 - the engine is still good; the sidecar says what it could not learn
        return {"name": "unknown", "compute_capability": "unknown"}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write beside ``path`` and rename, so a half-written engine never looks finished."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _parse(trt: Any, builder: Any, logger: Any, onnx_path: Path) -> Any:
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"TensorRT's ONNX parser rejected {onnx_path.name}: " + "; ".join(errors or ["no message"]))
    # the parser keeps references into the network: return both so neither is freed early
    return network, parser


def _profile(builder: Any, network: Any, batch: tuple[int, int, int], sequence: tuple[int, int, int] | None) -> tuple[Any, dict]:
    """One optimisation profile setting every input's min/opt/max shape (a text model's ids, mask, type ids)."""
    profile = builder.create_optimization_profile()
    shapes = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shapes[tensor.name] = profile_shapes(tuple(tensor.shape), tensor.name, batch, sequence)
        profile.set_shape(tensor.name, shapes[tensor.name]["min"], shapes[tensor.name]["opt"], shapes[tensor.name]["max"])
    return profile, {name: {k: list(v) for k, v in s.items()} for name, s in shapes.items()}


def build_engine(onnx_path: Path, engine_path: Path, *, min_batch: int = 1, opt_batch: int = 1, max_batch: int = 1,
                 sequence: tuple[int, int, int] | None = None, workspace_mb: int = 1024,
                 timing_cache: Path | None = None, gpu: dict[str, str] | None = None) -> dict[str, Any]:
    """Build ``engine_path`` from ``onnx_path`` and write its sidecar ``<engine>.json``; returns the sidecar.

    ``sequence``: min/opt/max sequence length of (batch, sequence) inputs (token ids and masks; int64
    inputs need no flag or cast: TensorRT's ONNX parser keeps INT64 I/O since 9.0).
    ``timing_cache``: a file read before the build when it exists (tactics timed once are reused) and
    written after it. ``gpu``: name and compute capability when the caller knows them (else nvidia-smi).
    """
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    if not onnx_path.is_file():
        raise BuildError(f"ONNX model not found: {onnx_path}")
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network, _parser = _parse(trt, builder, logger, onnx_path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mb) << 20)
    profile, shapes = _profile(builder, network, (min_batch, opt_batch, max_batch), sequence)
    config.add_optimization_profile(profile)
    if timing_cache is not None:
        cached = Path(timing_cache).read_bytes() if Path(timing_cache).is_file() else b""
        config.set_timing_cache(config.create_timing_cache(cached), False)  # False: refuse a cache from another GPU/version
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError("TensorRT could not build the engine; its log above says why")
    write_atomic(engine_path, bytes(memoryview(serialized)))
    if timing_cache is not None:
        write_atomic(Path(timing_cache), bytes(memoryview(config.get_timing_cache().serialize())))
    gpu = gpu or query_gpu()
    sidecar = {
        "format": FORMAT,
        "engine": engine_path.name,
        "engine_sha256": sha256_file(engine_path),
        "tensorrt_version": str(getattr(trt, "__version__", "unknown")),
        "gpu": gpu.get("name", "unknown"),
        "compute_capability": gpu.get("compute_capability", "unknown"),
        "strongly_typed": True,
        "profile": shapes,
        "workspace_mb": int(workspace_mb),
        "timing_cache": Path(timing_cache).name if timing_cache is not None else None,
        "source_onnx": onnx_path.name,
        "source_onnx_sha256": sha256_file(onnx_path),
        "note": "an engine runs only with the TensorRT version and on the GPU model it was built with",
    }
    write_atomic(engine_path.with_name(engine_path.name + ".json"), (json.dumps(sidecar, indent=2) + "\n").encode())
    return sidecar


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build_engine.py", description="Build a strongly typed TensorRT engine from an ONNX model.")
    parser.add_argument("--onnx", required=True, type=Path, help="the ONNX model (Q/DQ for int8, float16 for fp16)")
    parser.add_argument("--engine", required=True, type=Path, help="where to write the serialized engine")
    parser.add_argument("--min", dest="min_batch", type=int, default=1, help="smallest batch of the optimisation profile")
    parser.add_argument("--opt", dest="opt_batch", type=int, default=1, help="batch TensorRT tunes for")
    parser.add_argument("--max", dest="max_batch", type=int, default=1, help="largest batch of the optimisation profile")
    for flag, what in (("min", "shortest"), ("opt", "tuned-for"), ("max", "longest")):
        parser.add_argument(f"--{flag}-seq", type=int, default=None, help=f"{what} sequence of (batch, sequence) inputs")
    parser.add_argument("--workspace-mb", type=int, default=1024, help="workspace memory pool limit in MiB")
    parser.add_argument("--timing-cache", type=Path, default=None, help="timing cache file, reused and updated")
    args = parser.parse_args(argv)
    given = [v for v in (args.min_seq, args.opt_seq, args.max_seq) if v is not None]
    if len(given) not in (0, 3):
        parser.error("--min-seq, --opt-seq and --max-seq go together")
    sequence = (given[0], given[1], given[2]) if given else None
    try:
        sidecar = build_engine(args.onnx, args.engine, min_batch=args.min_batch, opt_batch=args.opt_batch,
                               max_batch=args.max_batch, sequence=sequence,
                               workspace_mb=args.workspace_mb, timing_cache=args.timing_cache)
    except BuildError as exc:
        raise SystemExit(f"build_engine.py: {exc}") from None
    print(json.dumps(sidecar, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
