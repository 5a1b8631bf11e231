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


def _optimize(recipe: str, *extra: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [PY, "-m", "pruneflow", "optimize", recipe, "--out", str(tmp / "runs"), "--quiet", *extra]


def _doctor(recipe: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [PY, "-m", "pruneflow", "doctor", recipe, "--json"]


def _bomb(tmp: Path) -> list[str]:
    (tmp / "bomb.yaml").write_text(BOMB)
    return [PY, "-m", "pruneflow", "validate", str(tmp / "bomb.yaml")]


def _nncf_build(tmp: Path) -> list[str]:
    return [PY, "-m", "pruneflow.qat.nncf_setup"]  # with TORCH_EXTENSIONS_DIR in tmp (see ENV): a first build


def _test_fast(tmp: Path) -> list[str]:
    return [PY, "-m", "pytest", "-m", "not slow", "-n", "2", "-q", "-p", "no:cacheprovider"]


#: name -> (what it measures, the command in a fresh temporary folder, the exit codes that count as done).
ENTRIES: dict[str, tuple[str, Callable[[Path], list[str]], tuple[int, ...]]] = {
    "demo": ("make demo's run once installed: pruneflow optimize recipes/quickstart.yaml",
             _optimize("recipes/quickstart.yaml"), (0,)),
    "nncf-build": ("the first build of NNCF's C++ extension (python -m pruneflow.qat.nncf_setup into an empty cache)",
                   _nncf_build, (0,)),
    "doctor-quickstart": ("pruneflow doctor recipes/quickstart.yaml", _doctor("recipes/quickstart.yaml"), (0,)),
    "doctor-resnet56-int8": ("pruneflow doctor recipes/resnet56-cifar10-int8.yaml (needs ../shared/data)",
                             _doctor("recipes/resnet56-cifar10-int8.yaml"), (0,)),
    "alias-bomb": ("pruneflow validate on a YAML alias bomb (refused by the node budget, exit 2)", _bomb, (2,)),
    "test-fast": ("make test-fast's pytest (two workers, one thread each, a quarter of the fuzz examples)",
                  _test_fast, (0,)),
    "minilm-embed": ("pruneflow optimize recipes/minilm-embed.yaml (needs ../shared/data)",
                     _optimize("recipes/minilm-embed.yaml"), (0,)),
    "minilm-sst2": ("pruneflow optimize recipes/minilm-sst2.yaml (needs ../shared/data)",
                    _optimize("recipes/minilm-sst2.yaml"), (0,)),
}

#: Environment each entry runs with, beyond this process's own.
ENV: dict[str, Callable[[Path], dict[str, str]]] = {
    "nncf-build": lambda tmp: {"TORCH_EXTENSIONS_DIR": str(tmp / "torch_extensions")},
    "test-fast": lambda tmp: {"OMP_NUM_THREADS": "1", "PRUNEFLOW_FUZZ_SCALE": "0.25"},
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
    what, command, ok = ENTRIES[name]
    with tempfile.TemporaryDirectory(prefix=f"pruneflow-timing-{name}-") as folder:
        tmp = Path(folder)
        argv = command(tmp)
        env = {**os.environ, "PYTHONPATH": str(REPO), **ENV.get(name, lambda _t: {})(tmp)}
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        shown = " ".join("python" if a == PY else a for a in argv).replace(str(tmp), "$TMP").replace(f"{REPO}/", "")
    if proc.returncode not in ok:
        raise SystemExit(f"{name}: exit {proc.returncode} (expected {ok})\n{proc.stderr[-3000:]}")
    return {"what": what, "seconds": round(seconds, 1), "minutes": round(seconds / 60, 1),
            "command": shown,
            "exit_code": proc.returncode, "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": host(), "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"entries to measure (default: all): {', '.join(ENTRIES)}")
    parser.add_argument("--list", action="store_true", help="list the entries and what each measures")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.list:
        for name, (what, _, _) in ENTRIES.items():
            print(f"{name:22} {what}")
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
