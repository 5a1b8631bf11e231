"""What a run leaves behind in memory: the record of each stage, the run's result, the flat metric namespace.

Its own module so that report.py (which renders a result) and pipeline.py (which makes one) both import
it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .artifacts import Artifact
from .gates import GateResult
from .units import dataframe, text_table


@dataclass
class StageRecord:
    """One stage as the run saw it: written to stage.json, so --resume can reuse it without running it."""

    id: str
    type: str
    index: int
    seconds: float
    metrics: dict[str, Any]
    key: str
    resumed: bool = False
    artifacts: list[str] = field(default_factory=list)
    tables: dict[str, list[dict]] = field(default_factory=dict)
    gates: list[dict] = field(default_factory=list)
    status: str = "done"
    #: Every file the stage wrote, relative to the run folder (its artifacts' files and any other), so the
    #: manifest lists exactly what is on disk and a --resume run can remove what an earlier run left.
    files: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(repr=False)
class RunResult:
    """What run_recipe returns: the CLI renders it and report.py writes it, neither of them reruns anything.

    From Python, ``print(result)`` shows the verdict, what changed against the model the run started from, and the
    gates; ``to_records(table)`` one of its tables as a list of dicts (``"artifacts"``, ``"stages"``, ``"gates"``,
    ``"headline"``), ``to_pandas(table)`` the same as a DataFrame::

        result = pruneflow.optimize("recipes/quickstart.yaml")
        print(result)
        result.to_pandas("artifacts")[["path", "accuracy", "size_bytes"]]
    """

    run_dir: Path
    exit_code: int
    stages: list[StageRecord]
    artifacts: list[Artifact]
    gates: list[GateResult]
    metrics: dict[str, Any]
    #: The run's task as ``Task.summary`` records it (type, headline metric, each metric's direction).
    task: dict[str, Any] = field(default_factory=dict)
    #: The model the run started from (``headline.StartPoint.summary``), None when no stage compressed it.
    start: dict[str, Any] | None = None
    #: Whether a recipe gate reads the task's headline metric (``gates.headline_gate``): ``{"gated": True}``, or
    #: ``{"gated": False, "message", "suggestion"}``, said beside the verdict in report.md, the terminal and --json.
    headline_gate: dict[str, Any] = field(default_factory=lambda: {"gated": True})
    #: Gates on the headline metric whose baseline is not the headline's start (``headline.baseline_notes``).
    baseline_notes: list[str] = field(default_factory=list)

    @property
    def headline(self) -> str:
        """The name of the task's headline metric (what tables show first)."""
        return str(self.task.get("headline", ""))

    def as_json(self) -> dict[str, Any]:
        """The object `pruneflow optimize --json` prints (documented in the README)."""
        return {
            "run_dir": str(self.run_dir),
            "exit_code": self.exit_code,
            "task": self.task,
            "stages": [
                {"name": s.id, "type": s.type, "seconds": round(s.seconds, 3), "resumed": s.resumed, "metrics": s.metrics}
                for s in self.stages
            ],
            "artifacts": [
                {k: a.as_dict()[k] for k in ("path", "kind", "target", "precision", "status", "sha256", "size_bytes", "parent", "metrics", "notes")}
                for a in self.artifacts
            ],
            "gates": [g.as_dict() for g in self.gates],
            "headline_gate": self.headline_gate,
            "headline": self.headline_rows(),
            "baseline_notes": self.baseline_notes,
        }

    TABLES = ("artifacts", "stages", "gates", "headline")

    def to_records(self, table: str = "artifacts") -> list[dict[str, Any]]:
        """One of the run's tables as flat dicts: ``artifacts`` (path, target, precision, status, size and every metric
        measured on it), ``stages`` (id, type, seconds and its metrics), ``gates`` or ``headline``."""
        if table == "artifacts":
            return [{"path": a.path, "target": a.target, "precision": a.precision, "form": a.form, "status": a.status,
                     "size_bytes": a.size_bytes, "parent": a.parent, **a.metrics} for a in self.artifacts]
        if table == "stages":
            return [{"stage": s.id, "type": s.type, "seconds": round(s.seconds, 3), "resumed": s.resumed, **s.metrics}
                    for s in self.stages]
        if table == "gates":
            return [g.as_dict() for g in self.gates]
        if table == "headline":
            return self.headline_rows()
        raise ValueError(f"unknown table {table!r}; one of {', '.join(self.TABLES)}")

    def to_pandas(self, table: str = "artifacts"):
        """``to_records(table)`` as a pandas DataFrame (pandas is not a dependency of pruneflow)."""
        return dataframe(self.to_records(table))

    def __str__(self) -> str:
        verdict = {0: "PASSED"}.get(self.exit_code, f"GATE FAILED (exit {self.exit_code})")
        lines = [f"RunResult: {self.run_dir} — {verdict}; {len(self.stages)} stages, {len(self.artifacts)} artifacts"]
        if not self.headline_gate.get("gated", True):
            lines.append(f"warning: {self.headline_gate['message']}")
        headline = self.headline_rows()
        if headline:
            lines += [f"against the model you started from (entering {(self.start or {}).get('stage')}):",
                      text_table(headline, ["what", "start", "result", "change"], max_rows=12, max_width=60)]
        if self.gates:
            failed = [g for g in self.gates if not g.passed]
            lines.append(f"gates: {len(self.gates) - len(failed)} passed, {len(failed)} failed")
            lines.append(text_table([{"gate": g.name, "result": "pass" if g.passed else "FAIL", "detail": g.message}
                                     for g in failed + [g for g in self.gates if g.passed]], max_rows=10, max_width=70))
        lines.append(f"tables: .to_records(table) / .to_pandas(table), table one of {', '.join(self.TABLES)}; "
                     f"{self.run_dir / 'report.md'}")
        return "\n".join(lines)

    __repr__ = __str__

    def headline_rows(self) -> list[dict[str, Any]]:
        """Before -> after against the model the run started from (``headline.headline_rows``)."""
        from .headline import headline_rows

        return headline_rows(self)


#: The attribute under which run_recipe leaves the partial RunResult on the exception that stopped a run.
_PARTIAL = "pruneflow_partial_run"


def attach_partial(exc: BaseException, result: RunResult) -> None:
    """Hang what finished before a failure on the exception, so the CLI's --json carries it with the error."""
    setattr(exc, _PARTIAL, result)


def partial_run(exc: BaseException) -> RunResult | None:
    """The RunResult of the stages that finished before ``exc`` stopped the run (None: no run folder was made)."""
    found = getattr(exc, _PARTIAL, None)
    return found if isinstance(found, RunResult) else None


def error_record(exc: BaseException) -> dict[str, Any]:
    """``{"exit_code", "type", "message", "hint"}`` of the exception that stopped a run (log, manifest, report)."""
    from .errors import EXIT_INTERRUPTED, EXIT_STAGE_FAILED, PruneflowError, RecipeError

    if isinstance(exc, PruneflowError):
        issues = [i.format().strip() for i in exc.issues] if isinstance(exc, RecipeError) else []
        return {"exit_code": exc.exit_code, "type": type(exc).__name__, "message": "\n".join([exc.message, *issues]),
                "hint": exc.hint}
    if isinstance(exc, KeyboardInterrupt):
        return {"exit_code": EXIT_INTERRUPTED, "type": type(exc).__name__, "message": "interrupted",
                "hint": "run again with --resume to continue from the finished stages"}
    return {"exit_code": EXIT_STAGE_FAILED, "type": type(exc).__name__, "message": str(exc),
            "hint": "an internal error: run again with -v for the traceback, and please report it"}


def flat_metrics(records: list[StageRecord], artifacts: list[Artifact]) -> dict[str, Any]:
    """One namespace for gates: ``STAGE.METRIC`` and ``TARGET.PRECISION.METRIC``."""
    flat: dict[str, Any] = {}
    for r in records:
        for k, v in r.metrics.items():
            flat[f"{r.id}.{k}"] = v
    for a in artifacts:
        if a.target:
            for k, v in a.metrics.items():
                flat[f"{a.metric_prefix}.{k}"] = v
    return flat
