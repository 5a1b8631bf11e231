"""How long things take, measured on this host (issue 42, items 6 and 7): the source of every duration the README
quotes, and the home of the speed bounds that used to be wall-clock asserts in unit tests.

Each entry runs as a user would run it, in a child process from the repository root, and is recorded with the host
(CPU model, ISA, usable CPUs) and the machine's load average before and after: a figure from 2 cores shared with
other work is not an idle machine's, and the file says which. Results merge into
``benchmarks/results/timings.json`` (an entry measured again replaces its old figure); ``tests/test_timings.py``
checks every duration in README.md against it.

    python benchmarks/timings.py --list
    python benchmarks/timings.py demo doctor-quickstart alias-bomb
    python benchmarks/timings.py minilm-embed                 # needs ../shared/data; many minutes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "timings.json"
PY = sys.executable

#: An alias bomb (10**9 strings if expanded): the recipe loader must refuse it by its node budget, quickly.
BOMB = "name: bomb\n" + "".join(
    f"{k}: &{k} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
    for k, p in zip("abcdefghi", ["", *"abcdefgh"]))


@dataclass
class Entry:
    """One duration: what it is, the command (given a fresh temporary folder), the exit codes that count as done,
    where it runs (default: the repository) and what it adds to the environment. ``checkout``: this checkout on
    PYTHONPATH (off for what installs pruneflow itself: pip would take the checkout for an installed copy)."""

    what: str
    argv: Callable[[Path], list[str]]
    ok: tuple[int, ...] = (0,)
    cwd: Callable[[Path], Path] = lambda tmp: REPO
    env: Callable[[Path], dict[str, str]] = lambda tmp: {}
    checkout: bool = True


def _optimize(recipe: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [PY, "-m", "pruneflow", "optimize", recipe, "--out", str(tmp / "runs"), "--quiet"]


def _doctor(recipe: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [PY, "-m", "pruneflow", "doctor", recipe, "--json"]


def _bomb(tmp: Path) -> list[str]:
    (tmp / "bomb.yaml").write_text(BOMB)
    return [PY, "-m", "pruneflow", "validate", str(tmp / "bomb.yaml")]


def _fresh_clone(tmp: Path) -> Path:
    """The committed tree (``git archive HEAD``) in ``tmp/clone``: what a fresh clone holds, no venv, no runs."""
    clone = tmp / "clone"
    clone.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(clone)], input=archive, check=True)
    return clone


ENTRIES: dict[str, Entry] = {
    "make-demo-fresh": Entry(
        "make demo in a fresh clone: a new .venv, torch's CPU build and every dependency from the configured index, "
        "NNCF's C++ extension built into an empty cache, then the quickstart run (exit 0: every gate passed)",
        lambda tmp: ["make", "demo", f"PYTHON={sys.executable if sys.prefix == sys.base_prefix else 'python3'}"],
        cwd=_fresh_clone, env=lambda tmp: {"XDG_CACHE_HOME": str(tmp / "cache")}, checkout=False),
    "demo": Entry("make demo's run once installed and built: pruneflow optimize recipes/quickstart.yaml",
                  _optimize("recipes/quickstart.yaml")),
    "nncf-build": Entry("the first build of NNCF's C++ extension (python -m pruneflow.qat.nncf_setup, empty cache)",
                        lambda tmp: [PY, "-m", "pruneflow.qat.nncf_setup"],
                        env=lambda tmp: {"TORCH_EXTENSIONS_DIR": str(tmp / "torch_extensions")}),
    "doctor-quickstart": Entry("pruneflow doctor recipes/quickstart.yaml", _doctor("recipes/quickstart.yaml")),
    "doctor-resnet56-int8": Entry("pruneflow doctor recipes/resnet56-cifar10-int8.yaml (needs ../shared/data)",
                                  _doctor("recipes/resnet56-cifar10-int8.yaml")),
    "alias-bomb": Entry("pruneflow validate on a YAML alias bomb (refused by the node budget, exit 2)", _bomb, (2,)),
    "test-fast": Entry("make test-fast's pytest (two workers, one thread each, a quarter of the fuzz examples)",
                       lambda tmp: [PY, "-m", "pytest", "-m", "not slow", "-n", "2", "-q", "-p", "no:cacheprovider"],
                       env=lambda tmp: {"OMP_NUM_THREADS": "1", "PRUNEFLOW_FUZZ_SCALE": "0.25"}),
    "minilm-embed": Entry("pruneflow optimize recipes/minilm-embed.yaml (needs ../shared/data)",
                          _optimize("recipes/minilm-embed.yaml")),
    "minilm-sst2": Entry("pruneflow optimize recipes/minilm-sst2.yaml (needs ../shared/data)",
                         _optimize("recipes/minilm-sst2.yaml")),
}


def host() -> dict:
    """The host a figure belongs to: CPU model, ISA flags, CPUs (pruneflow's own host record, trimmed)."""
    sys.path.insert(0, str(REPO))
    from pruneflow.runtime import host_info

    info = host_info()
    return {"cpu": info["cpu"]["model"], "isa": info["cpu"]["isa"], "usable_cpus": info["cpu"]["usable_cpus"],
            "logical_cpus": info["cpu"]["logical_cpus"], "os": info["os"], "python": info["python"],
            "torch": info["versions"].get("torch")}


def measure(name: str) -> dict:
    entry = ENTRIES[name]
    with tempfile.TemporaryDirectory(prefix=f"pruneflow-timing-{name}-") as folder:
        tmp = Path(folder)
        argv, cwd = entry.argv(tmp), entry.cwd(tmp)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | entry.env(tmp)
        if entry.checkout:
            env["PYTHONPATH"] = str(REPO)
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        shown = " ".join("python" if a == PY else a for a in argv).replace(str(tmp), "$TMP").replace(f"{REPO}/", "")
    if proc.returncode not in entry.ok:
        raise SystemExit(f"{name}: exit {proc.returncode} (expected {entry.ok})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    last = next((line for line in reversed(proc.stdout.splitlines()) if line.strip()), "")
    return {"what": entry.what, "seconds": round(seconds, 1), "minutes": round(seconds / 60, 1), "command": shown,
            "exit_code": proc.returncode, "last_line": last[-200:], "commit": _commit(),
            "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": host(), "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _commit() -> str:
    """The commit measured (with `+` when the tree had changes)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return head + ("+" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"entries to measure (default: all): {', '.join(ENTRIES)}")
    parser.add_argument("--list", action="store_true", help="list the entries and what each measures")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.list:
        for name, entry in ENTRIES.items():
            print(f"{name:22} {entry.what}")
        return
    unknown = sorted(set(args.names) - set(ENTRIES))
    if unknown:
        parser.error(f"unknown entries {unknown}; known: {', '.join(ENTRIES)}")
    results = json.loads(args.out.read_text()) if args.out.exists() else {"format": "pruneflow-timings/1", "entries": {}}
    for name in args.names or list(ENTRIES):
        entry = measure(name)
        results["entries"][name] = entry
        print(f"{name}: {entry['seconds']} s ({entry['minutes']} min), load {entry['load_average']}", flush=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
