"""Artifacts and the run manifest; atomic file writes.

Every file a run produces is written under a temporary name and renamed when complete, so a crash
or Ctrl-C never leaves a half-written model that looks finished.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import posixpath
import shutil
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from .errors import InputError

Status = Literal["built", "prepared", "failed"]

#: The one vocabulary of numeric precisions (recipe, manifest, report). How the numbers are encoded is
#: the artifact's ``form``: "cpu" | "tensorrt" for INT8 ONNX, "fakequant" for a quantized torch checkpoint.
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
#: The recipe's type for one of them (``precisions: [fp32, bf16, int8]``).
Precision = Literal["fp32", "fp16", "bf16", "int8"]

TRACKED_PACKAGES = ("pruneflow", "torch", "torch-pruning", "onnx", "onnxruntime", "nncf", "openvino", "datasets", "numpy")


@cache
def tool_versions() -> dict[str, str]:
    out = {}
    for name in TRACKED_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def combined_sha256(main: str, files: dict[str, str]) -> str:
    """One digest for an artifact of several files (OpenVINO's model.xml + model.bin).

    The sha256 of what ``sha256sum MAIN OTHER...`` prints in the main file's folder (``HASH  NAME`` a
    line, the main file first, then the others sorted by path), so it is reproducible with standard tools:
    ``cd export/openvino && sha256sum model.fp32.xml model.fp32.bin | sha256sum``.
    """
    folder = posixpath.dirname(main)
    order = [main] + sorted(p for p in files if p != main)
    text = "".join(f"{files[p]}  {posixpath.relpath(p, folder or '.')}\n" for p in order)
    return hashlib.sha256(text.encode()).hexdigest()


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it to ``final`` only if the block succeeds."""
    final = Path(final)
    refuse_special(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    except OSError as exc:  # /proc, a read-only mount, a name too long: no file can be made there
        if exc.errno in DISK_FULL_ERRNOS:
            raise
        raise InputError(f"cannot write {final}: {exc.strerror or exc} (a file cannot be created in {final.parent}); "
                         "nothing was written", hint="choose a path in a folder you can write to") from None
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 files; artifacts are shared like any other file
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:  # the data reaches the disk before the rename makes it visible
            os.fsync(fh.fileno())
        refuse_special(final)  # again: something may have been planted there meanwhile
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def refuse_special(path: Path) -> None:
    """Refuse (exit 2) to replace anything at ``path`` but a regular file: a symbolic link, a device, a FIFO, a
    socket or a folder planted there is named, never written through or turned into a file (``bench --json`` had
    replaced a character device by JSON; ``--force`` never changes this)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise InputError(f"cannot inspect {path}: {exc.strerror or exc}", hint="choose another output path") from exc
    if stat.S_ISREG(mode):
        return
    kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "a FIFO"
            if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
    raise InputError(f"{path} is {kind}: pruneflow writes its outputs as regular files and replaces only a regular file, "
                     "never writing through a link or over a device", hint=f"remove {path}, or write to another path")




def _foreign(st: os.stat_result, path: Path) -> str | None:
    """Why the object ``st`` describes is not one a run may write through or into; None when it may."""
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(path)})"
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        device = stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
        return ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if device
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
    if st.st_uid != os.geteuid():
        return f"owned by another user (uid {st.st_uid})"
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        return f"a hard link ({st.st_nlink} names for one file: writing it would change the others)"
    return None


def _planted(path: Path, why: str, what: str = "--resume") -> InputError:
    return InputError(f"{what}: {path} is {why}, inside the run folder. A run writes only its own files there, never "
                      "through a link or into an object someone else made, so it stops before writing anything",
                      hint=f"remove {path} (it may have been planted: look at it first), or run without --resume: "
                      "the run folder is then replaced")


def check_run_tree(run_dir: Path) -> None:
    """Before a run reuses a folder an earlier one left (``--resume``): every object under it, links not followed, must
    be a regular file or a folder of this user's, and a file must have one name. A link, FIFO, device or socket,
    another user's object, or a hard link anywhere under it is exit 2, named (issue 41: a ``logs/pruneflow.log``
    linked to a victim file had the run's log appended to it; a linked ``stages/01-train`` received ``model.pt``)."""
    folders = [run_dir]
    while folders:
        folder = folders.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                path = Path(entry.path)
                st = entry.stat(follow_symlinks=False)
                why = _foreign(st, path)
                if why:
                    raise _planted(path, why)
                if stat.S_ISDIR(st.st_mode):
                    folders.append(path)


def run_subdir(run_dir: Path, *parts: str) -> Path:
    """``run_dir/parts...``, each level made if missing and checked to be this user's real folder (not a link), so
    no write below it lands outside the run folder even when something was planted while the run went on."""
    path = run_dir
    for part in Path(*parts).parts:
        path = path / part
        try:
            path.mkdir()
        except FileExistsError:
            pass
        st = os.lstat(path)
        problem = _foreign(st, path) or (None if stat.S_ISDIR(st.st_mode) else "a file where a folder belongs")
        if problem:
            raise _planted(path, problem, "writing the run")
    return path


def open_run_log(path: Path) -> int:
    """A file descriptor appending to the run's log at ``path``: created if missing, never through a link, into a
    FIFO, another user's file or a hard link (the log is the one file a run appends to rather than replaces)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o666 & ~_umask())
    except OSError as exc:
        why = f"a symbolic link (to {os.readlink(path)})" if path.is_symlink() else f"not writable ({exc.strerror or exc})"
        raise _planted(path, why, "writing the run's log") from None
    found = _foreign(os.fstat(fd), path)
    if found:
        os.close(fd)
        raise _planted(path, found, "writing the run's log")
    os.set_blocking(fd, True)
    return fd


#: A full disk, or a full quota: what a run reports as "disk full" (exit 4), whichever stage wrote.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full_cause(exc: BaseException | None) -> BaseException | None:
    """The error in ``exc``'s chain that says the disk is full: an OSError with ENOSPC/EDQUOT, or what a C++
    writer raises instead (torch's "file write failed", OpenVINO's and protobuf's RuntimeError) when its message
    carries the system's "No space left on device". None when the disk is not the cause."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in chain):
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return (next((e for e in chain if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS), None)
            or next((e for e in reversed(chain) if "No space left on device" in str(e) or "Disk quota exceeded" in str(e)), None))

#: A manifest.json or stage.json larger than this is not a run's record (hundreds of artifacts take < 1 MB).
MAX_RECORD_BYTES = 32 * 1024 * 1024


def run_file(run_dir: Path, rel: Any, record: Path) -> Path:
    """``run_dir / rel`` for a path a run's ``record`` (manifest.json, stage.json) names, when it stays inside the
    run folder once every symbolic link is followed and is a regular file or absent. A run folder is data anyone
    may have edited: a path leading out of it (``../../other-run/model.onnx``, a link to a 6 GiB file elsewhere)
    or to a FIFO or device is refused (exit 2) naming the record and the path, never read (issue 27)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise InputError(f"{record}: names {rel!r} as a file of the run, which is not a path inside the run folder",
                         hint="the run folder was edited after the run: run the recipe again")
    path = Path(run_dir) / rel
    root, resolved = Path(run_dir).resolve(), path.resolve()
    if not resolved.is_relative_to(root):
        raise InputError(f"{record}: {rel} resolves to {resolved}, outside the run folder {root}; pruneflow reads a "
                         "run's files only inside it", hint="the run folder was edited after the run (a link or a path "
                         "pointing elsewhere): run the recipe again, or pass the file itself")
    if resolved.exists() and not resolved.is_file():
        raise InputError(f"{record}: {rel} is not a regular file ({resolved})", hint="run the recipe again")
    return path


def check_run_sizes(record: Path, files: list[Path], size_bytes: Any) -> None:
    """The bytes of an artifact's files against what ``record`` says they held: a file swapped after the run
    (another run's model, a larger file) is refused before it is read."""
    if not isinstance(size_bytes, int) or not all(f.is_file() for f in files):
        return
    held = sum(f.stat().st_size for f in dict.fromkeys(files))
    if held != size_bytes:
        raise InputError(f"{record}: {files[0].name} and its files hold {held:,} bytes where the run recorded "
                         f"{size_bytes:,}: the file was replaced after the run", hint="run the recipe again, or pass "
                         "the file itself (then it is not judged by this run's records)")


def read_record(path: Path) -> dict[str, Any]:
    """A run's JSON record (manifest.json, stage.json): a regular file of a sane size holding one JSON object;
    anything else is an InputError (exit 2) naming it, never a traceback."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{path} is not a regular file", hint="run the recipe again to rewrite it")
        if info.st_size > MAX_RECORD_BYTES:
            raise InputError(f"{path} holds {info.st_size:,} bytes, more than a run's record ever does "
                             f"({MAX_RECORD_BYTES:,})", hint="run the recipe again to rewrite it")
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot be read as JSON ({exc})", hint="run the recipe again to rewrite it") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a pruneflow record (a JSON object was expected)", hint="pass a run directory")
    return data


def manifest_entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The artifact records of a manifest read by ``read_record`` (anything else under ``artifacts`` is skipped:
    the file may have been edited)."""
    artifacts = manifest.get("artifacts")
    return [a for a in artifacts if isinstance(a, dict)] if isinstance(artifacts, list) else []

def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename a finished temporary folder to ``final``, replacing an older one without a gap."""
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700 folders
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, notify: Callable[[str], None] = lambda message: None) -> Iterator[Path]:
    """Hold the run folder for the block: an exclusive ``flock`` on ``OUT/.NAME.lock``, the owner's pid and
    start time written in it, so a second run into the same folder stops before touching it.

    The lock file lives beside the folder (a run replaces the folder itself) and is left in place, emptied,
    when the block ends; the kernel drops the lock of a killed owner, and the pid it left behind is
    reported through ``notify`` as taken over. Raises InputError (exit 2) when another process holds it.
    """
    import fcntl

    lock = Path(run_dir).parent / f".{Path(run_dir).name}.lock"
    refuse_special(lock)  # a link planted at the lock (-> any file) had that file emptied
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666 & ~_umask())
    except OSError as exc:
        raise InputError(f"cannot create the run folder's lock {lock}: {exc.strerror or exc}",
                         hint="choose an --out folder you can write to, or remove what is at the lock's path") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # planted between the check and the open
        os.close(fd)
        raise InputError(f"{lock} is not a regular file: pruneflow keeps its run lock in a file it creates",
                         hint=f"remove {lock}, or use another --out")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _lock_owner(fd)
            raise InputError(
                f"run folder {run_dir} is in use by pid {owner.get('pid', '?')} since {owner.get('since', '?')} "
                f"(lock {lock}); nothing was written", hint="wait for that run to finish, or use another --out") from None
        previous = _lock_owner(fd)
        if previous.get("pid") not in (None, os.getpid()):
            notify(f"{run_dir}: taking over the lock of pid {previous['pid']} (since {previous.get('since', '?')}), "
                   "which ended without releasing it")
        since = datetime.now(timezone.utc).isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "since": since}).encode(), 0)
        try:
            yield lock
        finally:
            os.ftruncate(fd, 0)  # released cleanly: no owner left to report
    finally:
        os.close(fd)  # drops the flock


def _lock_owner(fd: int) -> dict[str, Any]:
    """The owner record in a lock file ({} when empty or unreadable)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, OSError):
        return {}
    return record if isinstance(record, dict) else {}


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Strict JSON (RFC 8259): NaN and infinities are written as null, which every parser reads."""
    write_text_atomic(path, json.dumps(finite(data), indent=2, sort_keys=False, default=_json_default, allow_nan=False) + "\n")


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (numpy and torch scalars included) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy or torch scalar
        return finite(value.item())
    return value


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return obj.as_posix()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


@dataclass
class Artifact:
    """One file a run produced. ``path`` is relative to the run directory."""

    path: str
    kind: str  # "checkpoint" | "onnx" | "openvino" | ...
    producer: str  # the stage id that wrote it
    status: Status = "built"
    target: str | None = None
    #: One vocabulary everywhere (recipe, manifest, report): fp32 | fp16 | bf16 | int8 (``PRECISIONS``).
    precision: str | None = None
    #: How an int8 artifact encodes its quantization: "cpu" (uint8 activations, onnxruntime/OpenVINO on
    #: x86) or "tensorrt" (TensorRT's explicit quantization) for INT8 ONNX; "fakequant" for a quantized
    #: torch checkpoint (float weights with quantizer ranges, what QAT trains).
    form: str | None = None
    #: The file's sha256; for an artifact of several files (``files``), their combined digest (``combined_sha256``).
    sha256: str | None = None
    size_bytes: int | None = None
    parent: str | None = None  # path of the artifact (or "source:..." description) it was made from
    metrics: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Every file of an artifact of several (e.g. OpenVINO's model.xml and model.bin), the main one included:
    #: relative path -> its own sha256. Empty for a one-file artifact.
    files: dict[str, str] = field(default_factory=dict)
    #: What a deployment needs to feed the file (input name/shape/dtype/layout, preprocessing, labels;
    #: pruneflow/deployment.py), also written into the file itself. None for checkpoints.
    deployment: dict[str, Any] | None = None
    tool_versions: dict[str, str] = field(default_factory=tool_versions)

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"artifact {self.path}: precision {self.precision!r} is not one of {', '.join(PRECISIONS)} "
                             "(an encoding such as TensorRT's goes in `form`)")

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Artifact":
        """An artifact from its manifest/stage.json record (``as_dict``); a record of another layout raises
        TypeError (a key that is not a field) or ValueError (a precision outside ``PRECISIONS``)."""
        return cls(**record)

    @classmethod
    def from_file(cls, run_dir: Path, file: Path, **kwargs: Any) -> "Artifact":
        file = Path(file)
        return cls(
            path=file.resolve().relative_to(run_dir.resolve()).as_posix(),
            sha256=sha256_file(file),
            size_bytes=file.stat().st_size,
            **kwargs,
        )

    def verify(self, run_dir: Path) -> bool:
        """True when every file of the artifact exists and still has its recorded sha256 (and, for several
        files, their combined digest is ``sha256``)."""
        if self.sha256 is None:
            return False
        if not self.files:  # one file: sha256 is its own
            recorded = {self.path: self.sha256}
        elif self.path not in self.files:  # several files always list the main one (add_file)
            return False
        else:
            recorded = dict(self.files)
            if combined_sha256(self.path, self.files) != self.sha256:
                return False
        try:  # a path out of the run folder, or to a FIFO, is not this run's file: run the stage again
            paths = {rel: run_file(run_dir, rel, run_dir / "stage.json") for rel in recorded}
            check_run_sizes(run_dir / "stage.json", list(paths.values()), self.size_bytes)  # before hashing what may be huge
        except InputError:
            return False
        return all(sha is not None and paths[rel].is_file() and sha256_file(paths[rel]) == sha
                   for rel, sha in recorded.items())

    def add_file(self, run_dir: Path, file: Path) -> None:
        """Add a companion file: its hash joins ``files`` (with the main file's), ``sha256`` becomes their
        combined digest and ``size_bytes`` their sum."""
        file = Path(file)
        if self.path not in self.files:
            self.files = {self.path: self.sha256 or sha256_file(run_dir / self.path), **self.files}
        self.files[file.resolve().relative_to(run_dir.resolve()).as_posix()] = sha256_file(file)
        self.size_bytes = (self.size_bytes or 0) + file.stat().st_size
        self.sha256 = combined_sha256(self.path, self.files)

    @property
    def label(self) -> str:
        """``onnx.int8``, ``onnx.int8_tensorrt``: the artifact's name in metrics and gates (the default
        ``cpu`` form is unnamed, so the common case reads ``onnx.int8``)."""
        form = f"_{self.form}" if self.form and self.form != "cpu" else ""
        return f"{self.target}.{self.precision}{form}"

    @property
    def metric_prefix(self) -> str:
        """Where its metrics sit in the run's flat namespace (gates): ``onnx.int8``; an artifact of a second export
        stage (id other than ``export``) is prefixed with that stage, so it cannot shadow the first's."""
        return self.label if self.producer == "export" else f"{self.producer}.{self.label}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Manifest:
    """manifest.json: the lineage of every artifact of a run, rewritten atomically after each stage."""

    FILE = "manifest.json"
    FORMAT = "pruneflow-manifest/1"

    def __init__(self, run_dir: Path, recipe_name: str):
        self.run_dir = run_dir
        self.recipe_name = recipe_name
        self.created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.stages: list[dict[str, Any]] = []
        self.artifacts: list[Artifact] = []
        self.status = "running"
        #: The machine the run ran on (``pruneflow.runtime.host_info``: CPU model, ISA flags, GPUs, runtime
        #: versions), set by the pipeline: every latency figure in the manifest was measured there.
        self.host: dict[str, Any] | None = None
        #: The run's task (``Task.summary``: type, headline metric, each metric's direction), set by the pipeline.
        self.task: dict[str, Any] | None = None
        #: Set when a stage failed: the stage, the error (type, message, hint, exit code) and the files it left.
        self.failure: dict[str, Any] | None = None
        #: What a stage chose by measuring on this host, by stage id (the export stage: per target the precision it
        #: delivers, the INT8 form, OpenVINO's hint; with the stage's resume key and the host): ``--resume`` takes a
        #: choice again while the key holds, so a resumed run writes the bytes an uninterrupted one writes.
        self.choices: dict[str, Any] = {}
        #: The hosts earlier runs resumed into this folder ran on, when another than ``host`` (oldest first): the
        #: figures of the stages this run reused were measured there, if they depend on the host at all.
        self.earlier_hosts: list[dict[str, Any]] = []
        #: This run resumed a folder the last run left on another host (not written: ``earlier_hosts`` says it).
        self.host_changed = False

    def add_stage(self, record: dict[str, Any], artifacts: list[Artifact]) -> None:
        self.stages.append(record)
        self.artifacts.extend(artifacts)
        self.write()

    def deployment(self) -> dict[str, Any] | None:
        """The run's deployment record: that of its first exported artifact (each artifact's own record,
        which may differ in the batch dimension, stays on it)."""
        return next((a.deployment for a in self.artifacts if a.deployment), None)

    def find(self, path: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.path == path), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": self.FORMAT,
            "recipe": self.recipe_name,
            "created": self.created,
            "status": self.status,
            "tool_versions": tool_versions(),
            "host": self.host,
            "task": self.task,
            "deployment": self.deployment(),
            "stages": self.stages,
            "artifacts": [a.as_dict() for a in self.artifacts],
            **({"choices": self.choices} if self.choices else {}),
            **({"earlier_hosts": self.earlier_hosts} if self.earlier_hosts else {}),
            **({"failure": self.failure} if self.failure else {}),
        }

    def write(self) -> None:
        write_json_atomic(self.run_dir / self.FILE, self.as_dict())

    @classmethod
    def read(cls, run_dir: Path) -> dict[str, Any]:
        """The manifest of ``run_dir`` (``read_record``: exit 2 naming the file when it is not one)."""
        return read_record(Path(run_dir) / cls.FILE)

