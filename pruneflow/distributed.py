"""Scale-out on torchrun: DistributedDataParallel for the fine-tuning stages, rank 0 alone writing the run.

``pruneflow optimize RECIPE --nproc N`` starts N local workers through torch's elastic launcher (the
machinery behind ``torchrun``: :func:`launch`); plain ``torchrun --nproc-per-node N -m pruneflow optimize
RECIPE`` (multi-node: torchrun's ``--nnodes``/``--rdzv-*`` flags) starts the same workers. Each worker:

- joins the process group (gloo on CPU, nccl with ``device: cuda``; :func:`init`), with a timeout on
  every collective so a lost rank ends the job with an error instead of a hang;
- runs the stages that train (``train``, ``prune``'s KD fine-tuning, ``qat``) with the model wrapped in
  DistributedDataParallel (:func:`wrap`), each rank on its shard of the training split
  (torch's DistributedSampler, seeded: shards disjoint and reproducible; :func:`shard`); the recipe's
  ``batch_size`` stays the global batch, split over the ranks;
- evaluates the whole eval split on its own replica (replicas are identical: :func:`sync_state` after every
  epoch), so every rank takes the same decisions without exchanging figures; rank 0's are reported;
- takes importance scores from rank 0 (:func:`from_main`) and checks after every prune round that every
  rank holds the same structure (:func:`check_same_structure`).

Rank 0 runs the whole recipe into the run folder. The other ranks run the recipe only up to its last
training stage, into a private scratch folder that is removed afterwards, then wait for rank 0 and exit
with its exit code (:func:`finish`). torch's launcher ends every worker when one fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from torch import nn

from .config import usable_cpus
from .errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_STAGE_FAILED, MissingDependencyError, StageError, UsageError

#: Seconds any collective may wait for the other ranks (a lost rank ends the job after this at most).
TIMEOUT_ENV = "PRUNEFLOW_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600
#: Seconds the other ranks wait for rank 0 to finish the stages it runs alone (exports, measurements).
FINAL_WAIT_ENV = "PRUNEFLOW_DIST_FINAL_WAIT"
DEFAULT_FINAL_WAIT_S = 6 * 3600
#: When set, ranks other than 0 keep their scratch runs under this folder (for debugging and tests).
SCRATCH_ENV = "PRUNEFLOW_RANK_SCRATCH"

T = TypeVar("T")


@dataclass
class _Session:
    control: Any = None  # a gloo group for Python objects (scores, structures) whatever the backend
    final: Any = None  # a gloo group with a long timeout: the wait for rank 0's exit code
    released: bool = False  # rank 0 passed the last training stage: the other ranks wait in finish()


_session = _Session()


def in_worker() -> bool:
    """True in a process started by torchrun (or ``--nproc``) as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


#: Set by ``--nproc``'s launcher for its workers: its pid, which they die with.
LAUNCHER_ENV = "PRUNEFLOW_LAUNCHER_PID"


def bind_to_launcher() -> None:
    """A worker of ``--nproc`` asks the kernel for SIGTERM when its launcher dies (Linux ``PR_SET_PDEATHSIG``):
    a launcher killed for memory or by ``kill -9`` had left every worker running, holding gigabytes (issue 27).
    A launcher already gone before the request took effect means this worker stops now."""
    import signal

    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # no prctl here: nothing more can be asked of the kernel
        return
    if str(os.getppid()) != launcher:
        os._exit(EXIT_INTERRUPTED)


def active() -> bool:
    """True once :func:`init` joined a process group of more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if active() else 0


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def _seconds(env: str, default: int) -> timedelta:
    raw = os.environ.get(env)
    try:
        seconds = default if raw is None else int(raw)
    except ValueError:
        seconds = 0
    if seconds < 1:
        raise UsageError(f"{env}={raw!r} is not a whole number of seconds of at least 1", hint=f"e.g. {env}={default}")
    return timedelta(seconds=seconds)


def check_settings() -> None:
    """The environment's timeouts (``PRUNEFLOW_DIST_TIMEOUT``, ``PRUNEFLOW_DIST_FINAL_WAIT``), read once in the launcher
    before any worker starts: a bad one is one error (one JSON object under ``--json``), not one a rank."""
    _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
    _seconds(FINAL_WAIT_ENV, DEFAULT_FINAL_WAIT_S)


def check_device(device: str, nproc: int) -> None:
    """``cuda`` where torch sees no CUDA device (or fewer than ``nproc``, or than torchrun's processes on this
    node): exit 3 before any work. ``auto`` is checked as what it resolves to. On the CPU, more processes than
    usable CPUs is exit 2 before any worker starts (``--nproc 64`` on 2 cores had the launcher killed for memory
    and 35 orphaned workers holding 5.9 GB). With several processes, the environment's timeouts too (``check_settings``)."""
    if nproc > 1 or in_worker():
        check_settings()
    if resolve_device(device) != "cuda":
        if nproc > usable_cpus():
            raise UsageError(f"--nproc {nproc}: this machine lets the process use {usable_cpus()} CPU(s), and each training "
                             "process on the CPU needs one", hint=f"use --nproc {usable_cpus()} or fewer")
        return
    nproc = max(nproc, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if not torch.cuda.is_available():
        raise MissingDependencyError(
            "device cuda was asked for (--device or the recipe's `device`), but torch sees no CUDA device here "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'})",
            hint="use --device cpu (or device: auto), or run on a machine with an NVIDIA GPU and a CUDA build of torch")
    if nproc > torch.cuda.device_count():
        raise MissingDependencyError(
            f"{nproc} processes with device cuda need one GPU each, and torch sees {torch.cuda.device_count()} on this machine",
            hint=f"use --nproc (or torchrun's --nproc-per-node) {torch.cuda.device_count()} or fewer")


def resolve_device(device: str) -> str:
    """The recipe's ``device`` as the pipeline resolves it (``auto``: CUDA when available)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def init(device: str) -> None:
    """Join the process group torchrun describes in the environment: nccl for ``cuda``, else gloo."""
    import torch.distributed as dist

    timeout = _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
    backend = "gloo"
    if resolve_device(device) == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    dist.init_process_group(backend, timeout=timeout)
    _session.control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    _session.final = dist.new_group(backend="gloo", timeout=_seconds(FINAL_WAIT_ENV, DEFAULT_FINAL_WAIT_S))
    _session.released = False


#: What gloo and nccl say when another rank is gone (DDP's reducer passes it on as a plain RuntimeError).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "ProcessGroupNCCL", "NCCL error",
              "Timed out waiting")


@contextlib.contextmanager
def peers_guard(where: str) -> Iterator[None]:
    """A collective that fails because another rank died (its sockets closed, or the timeout passed)
    becomes a StageError saying so: the other rank's own error is the one to read."""
    import torch.distributed as dist

    try:
        yield
    except RuntimeError as exc:  # DDP's reducer raises gloo's and nccl's failures as plain RuntimeErrors
        if not active() or not (isinstance(exc, dist.DistError) or any(m in str(exc) for m in _PEER_LOST)):
            raise
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise StageError(f"{where}: rank {rank()} lost contact with the other ranks of the job ({first}); another "
                         "rank failed or was stopped, and its own message says why",
                         hint=f"read the other ranks' errors; a rank that is only slow needs a longer {TIMEOUT_ENV} "
                         f"(seconds, default {DEFAULT_TIMEOUT_S})") from exc


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _session.control = _session.final = None


def release() -> None:
    """Rank 0 finished the last training stage: from now on the other ranks wait in :func:`finish`."""
    _session.released = True


def finish(code: int) -> int:
    """Rank 0 tells the waiting ranks its exit code; they return it. Rank 0 tells them only once they
    wait (after :func:`release`), and a rank waits only when its own part succeeded: a rank that fails
    exits at once and torch's launcher stops the others (whose collectives fail or are interrupted)."""
    import torch.distributed as dist

    if not active():
        return code
    if is_main() and not _session.released:
        return code
    if not is_main() and code != EXIT_OK:  # this rank failed: exit now (the launcher stops the others)
        return code
    box = [code]
    try:
        dist.broadcast_object_list(box, src=0, group=_session.final)
    except RuntimeError:  # a waiting rank died (rank 0's run stands) or rank 0 did (this rank cannot know how it ended)
        return code if is_main() else EXIT_STAGE_FAILED
    return int(box[0])


# --------------------------------------------------------------------------- training under DDP


def wrap(model: nn.Module, device: str) -> nn.Module:
    """``model`` in DistributedDataParallel (its parameters and buffers broadcast from rank 0 on wrapping);
    ``model`` itself outside torchrun."""
    if not active():
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [torch.cuda.current_device()] if str(device).startswith("cuda") else None
    # Buffers stay per rank while training (BatchNorm statistics of each shard); sync_state averages them.
    # torch 2.13 renamed the switch (broadcast_buffers=False still works there, with a FutureWarning).
    import inspect

    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    switch: dict[str, Any] = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=ids, **switch)


def global_batch_share(batch_size: int) -> int:
    """This rank's part of a global batch of ``batch_size`` (rounded up: every rank takes as many steps)."""
    return max(1, -(-batch_size // world()))


def shard_size(samples: int) -> int:
    """Samples in each rank's shard of ``samples`` (DistributedSampler pads the last one to this)."""
    return -(-samples // world())


def shard(data: Any, epoch: int, seed: int) -> Any:
    """``data`` (a DataBundle) with its train split cut to this rank's shard for ``epoch``
    (:func:`shard_indices`); ``data`` itself outside torchrun."""
    if not active() or data.train is None:
        return data
    if data.stream is not None:  # a streamed split: each rank reads its own row range of the shards (logged there)
        return replace(data, stream=data.stream.shard(rank(), world()))
    return replace(data, train=_take(data.train, shard_indices(len(data.train), epoch, seed, rank(), world())))


def shard_indices(samples: int, epoch: int, seed: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s sample indices for ``epoch``: torch's DistributedSampler draws one permutation from
    ``seed + epoch`` and deals it out, so the shards are disjoint, equally long (the last padded with the
    first indices again: every rank takes as many optimizer steps) and reproducible."""
    from torch.utils.data import DistributedSampler

    rows: Any = range(samples)  # the sampler needs only len()
    sampler: DistributedSampler[int] = DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return torch.tensor(list(iter(sampler)), dtype=torch.long)


def _take(split: Any, idx: torch.Tensor) -> Any:
    """The rows ``idx`` of every tensor field of ``split`` (a dataclass; dicts/tuples of tensors too)."""
    from dataclasses import fields

    def pick(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[idx]
        if isinstance(value, dict):
            return {k: pick(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(pick(v) for v in value)
        return value

    return replace(split, **{f.name: pick(getattr(split, f.name)) for f in fields(split) if f.init})


def sync_state(*modules: nn.Module, average_buffers: bool = False) -> None:
    """Make every replica bit-identical: parameters and buffers broadcast from rank 0.

    ``average_buffers`` (after training): floating-point buffers (BatchNorm running statistics) are averaged
    over the ranks first: each rank updated them from its own shard (DDP runs with ``broadcast_buffers=False``),
    and the mean of the ranks' estimates stands for the whole epoch's data as one process's estimate does.
    """
    import torch.distributed as dist

    if not active():
        return
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                dist.broadcast(p.data, src=0)
            for b in module.buffers():
                if average_buffers and b.is_floating_point():
                    dist.all_reduce(b.data)
                    b.data /= world()
                dist.broadcast(b.data, src=0)  # the mean, bit-identical everywhere (reductions may round apart)


def average_gradients(modules: Sequence[nn.Module]) -> None:
    """All-reduce (mean) the gradients of modules trained beside the DDP model (feature-KD projections):
    they are called inside the loss, not in the wrapped forward, so DDP does not see them."""
    import torch.distributed as dist

    if not active():
        return
    for module in modules:
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world()


def all_sum(values: Sequence[float]) -> list[float]:
    """The sums over the ranks of ``values`` (an epoch's loss and the task's metric sums); ``values`` alone otherwise."""
    import torch.distributed as dist

    if not active():
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, group=_session.control)
    return t.tolist()


# --------------------------------------------------------------------------- decisions taken once


def from_main(compute: Callable[[], T], device: str | torch.device | None = None) -> T:
    """``compute()`` on rank 0, its result broadcast to every rank (tensors moved to ``device`` there)."""
    import torch.distributed as dist

    if not active():
        return compute()
    box = [_to_cpu(compute()) if is_main() else None]
    dist.broadcast_object_list(box, src=0, group=_session.control)
    return _to_device(box[0], device)


def _to_cpu(obj: Any) -> Any:
    return _map_tensors(obj, lambda t: t.detach().cpu())


def _to_device(obj: Any, device: str | torch.device | None) -> Any:
    return obj if device is None else _map_tensors(obj, lambda t: t.to(device))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def structure(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter's and buffer's name and shape: what pruning changes."""
    return [(n, tuple(t.shape)) for n, t in [*model.named_parameters(), *model.named_buffers()]]


def check_same_structure(model: nn.Module, where: str) -> None:
    """Raise a StageError when the ranks' models differ in structure after ``where`` (never expected:
    scores come from rank 0 and planning is deterministic; this makes a divergence loud, not silent)."""
    import torch.distributed as dist

    if not active():
        return
    mine = hashlib.sha256(repr(structure(model)).encode()).hexdigest()
    every: list[Any] = [None] * world()
    dist.all_gather_object(every, mine, group=_session.control)
    if len(set(every)) != 1:
        differ = [r for r, h in enumerate(every) if h != every[0]]
        raise StageError(f"{where}: the model's structure differs between rank 0 and rank(s) {differ}",
                         hint="please report this with the recipe; run with --nproc 1 meanwhile")


# --------------------------------------------------------------------------- the ranks' runs


def _under_ddp(config: Any) -> bool:
    """The stage's class declares that it trains under DDP (``Stage.runs_under_ddp``)."""
    from . import registry

    return registry.stages.get(config.type).runs_under_ddp


def worker_recipe(loaded: Any) -> Any | None:
    """What a rank other than 0 runs: the recipe up to its last training stage (one whose class declares
    ``runs_under_ddp``), gates off; None when the recipe has no training stage (the rank then only waits)."""
    stages = list(loaded.recipe.stages)
    last = max((i for i, s in enumerate(stages) if _under_ddp(s)), default=None)
    if last is None:
        return None
    recipe = loaded.recipe.model_copy(update={"stages": stages[: last + 1], "gates": []})
    return replace(loaded, recipe=recipe)


def last_training_stage_id(loaded: Any) -> str | None:
    """The id of the recipe's last training stage (rank 0 releases the others when it finishes)."""
    from .recipe.rules import stage_ids

    stages = list(loaded.recipe.stages)
    ids = stage_ids(stages)
    found = [ids[i] for i, s in enumerate(stages) if _under_ddp(s)]
    return found[-1] if found else None


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A rank's private run folder: removed afterwards, kept under $PRUNEFLOW_RANK_SCRATCH when set."""
    keep = os.environ.get(SCRATCH_ENV)
    if keep:
        path = Path(keep) / f"rank{rank()}"
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=f"pruneflow-rank{rank()}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- the launcher (--nproc)


def launch(nproc: int, args: list[str], echo: Callable[[str], None]) -> int:
    """Run ``python -m pruneflow ARGS`` in ``nproc`` local workers through torch's elastic launcher (what
    ``torchrun --standalone --nproc-per-node N`` does); returns rank 0's exit code, or the code of the rank
    that failed first (with a line saying so) when another rank failed before it."""
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        with _worker_env(nproc), _quiet_launcher():
            elastic_launch(config, sys.executable)("-m", "pruneflow", *args)
    except ChildFailedError as exc:
        return _job_code(exc.failures, echo)
    except SignalException as exc:  # SIGTERM/SIGINT to the launcher: passed on to the workers, which stop cleanly
        echo(f"stopped by signal {exc.sigval}: the workers were told to stop; finished stages are kept")
        return EXIT_INTERRUPTED
    return EXIT_OK


def _job_code(failures: dict, echo: Callable[[str], None]) -> int:
    """Rank 0's exit code when it failed (it ran the recipe), else the first failed rank's; a line names
    every other rank that failed, whose message (printed by that rank) is the cause to read."""
    others = sorted(r for r in failures if r != 0)
    if others:
        what = ", ".join(f"rank {r} ({_how(failures[r].exitcode)})" for r in others)
        echo(f"worker {what} failed; torch's launcher stopped every worker (the rank's own message is above)")
    code = failures[0].exitcode if 0 in failures else failures[others[0]].exitcode
    return code if code > 0 else EXIT_STAGE_FAILED


def _how(code: int) -> str:
    return f"exit code {code}" if code >= 0 else f"signal {-code}"


@contextlib.contextmanager
def _worker_env(nproc: int) -> Iterator[None]:
    """The workers import this checkout (not another installed copy) and share the CPU cores between them
    (torchrun would give each one thread); the launching process's environment is restored after."""
    saved = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // nproc))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """torch's launcher logs its configuration at INFO and each failure at ERROR; we report the outcome."""
    import logging

    names = ["torch.distributed.elastic", "torch.distributed.launcher"]
    levels = [logging.getLogger(n).level for n in names]
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for n, level in zip(names, levels):
            logging.getLogger(n).setLevel(level)
