"""NNCF's C++ extension build (issue 14, fault 5; issue 26): a lock a killed build left is removed with a message, a
live build is waited for, and the extension is not rebuilt when another ninja comes first on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import wait_for, write

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def holder(lock: Path) -> subprocess.Popen:
    """A process holding ``lock`` open, as torch's FileBaton does while it builds."""
    proc = subprocess.Popen([PYTHON, "-c", f"import os,sys,time; fd=os.open({str(lock)!r}, os.O_RDONLY); "
                                           "print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def build_lock(folder: Path) -> Path:
    lock = folder / "nncf" / "quantized_functions_cpu" / f"{torch.__version__}" / "lock"
    write(lock, "")
    return lock


def test_a_stale_nncf_build_lock_is_removed_with_a_message(tmp_path, monkeypatch):
    from pruneflow.qat import nncf_setup

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = build_lock(tmp_path / "ext")
    said: list[str] = []
    assert nncf_setup.configure(notify=said.append) == tmp_path / "ext"
    assert not lock.exists()
    assert len(said) == 1 and str(lock) in said[0] and "stale" in said[0] and "no process holds it" in said[0]


def test_a_live_build_is_waited_for_with_messages_and_its_lock_cleared_when_its_owner_dies(tmp_path, monkeypatch):
    from pruneflow.qat import nncf_setup

    lock = build_lock(tmp_path / "ext")
    owner = holder(lock)
    said: list[str] = []
    try:
        assert nncf_setup.lock_holders(lock) == [owner.pid]
        nncf_setup.clear_stale_locks(tmp_path / "ext", said.append)
        assert lock.exists() and said == []  # a live owner's lock stays (and a one-off check says nothing)
        with nncf_setup.watching_locks(tmp_path / "ext", said.append, every=0.1):
            wait_for(lambda: said, 10, "a waiting message")
            assert f"waiting for NNCF's C++ extension build by pid {owner.pid}" in said[0] and str(lock) in said[0]
            owner.kill()
            owner.wait()
            wait_for(lambda: not lock.exists(), 10, "the stale lock to be removed")
        assert "removed a stale lock" in said[-1]
    finally:
        owner.kill()


def test_a_lock_whose_owner_cannot_be_looked_up_is_judged_by_its_age(tmp_path, monkeypatch):
    from pruneflow.qat import nncf_setup

    monkeypatch.setattr(nncf_setup, "lock_holders", lambda lock: None)
    young, old = build_lock(tmp_path / "a"), build_lock(tmp_path / "b")
    past = time.time() - nncf_setup.STALE_LOCK_SECONDS - 60
    os.utime(old, (past, past))
    said: list[str] = []
    waiting: dict = {}
    nncf_setup.clear_stale_locks(tmp_path / "a", said.append, waiting)
    nncf_setup.clear_stale_locks(tmp_path / "b", said.append, waiting)
    assert young.exists() and not old.exists()
    assert "waiting for NNCF's C++ extension build by an unknown process" in said[0] and "min old" in said[1]


def test_a_real_load_with_a_stale_lock_finishes_instead_of_hanging(tmp_path):
    """The built extension copied from the cache into a fresh folder, a killed build's lock planted: the load
    (before: a silent endless wait) takes seconds and says what it removed."""
    from pruneflow.qat.nncf_setup import extensions_dir

    built = extensions_dir() / "nncf" / "quantized_functions_cpu"
    if not any(built.glob("*/quantized_functions_cpu.so")):
        pytest.skip(f"NNCF's extension is not built in {built}; run `python -m pruneflow.qat.nncf_setup` first")
    shutil.copytree(built, tmp_path / "ext" / "nncf" / "quantized_functions_cpu", ignore=shutil.ignore_patterns("lock"))
    lock = next((tmp_path / "ext").rglob("quantized_functions_cpu.so")).parent / "lock"
    lock.touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([PYTHON, "-m", "pruneflow.qat.nncf_setup"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"removed a stale lock of NNCF's C++ extension build, {lock} (no process holds it" in done.stderr
    assert "NNCF CPU extension ready" in done.stdout and not lock.exists()


@pytest.mark.slow  # two interpreters importing NNCF (~30 s); builds nothing when the cache is warm, as CI's is
def test_the_nncf_extension_is_not_rebuilt_when_the_shell_puts_another_ninja_first(tmp_path):
    """With the environment activated torch ran pip's ninja 1.13, without it the system's 1.11: each took the
    other's build as stale, and the extension was rebuilt at every switch (1.5-3 minutes, issue 26). The
    environment's own ninja is now put first whatever PATH says: the second command rebuilds nothing."""
    import os
    import subprocess
    import sys

    from pruneflow.qat.nncf_setup import extension_state

    venv_bin = str(Path(sys.executable).parent)
    others = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    orders = {"activated": [venv_bin, *others], "not activated": [*others, venv_bin]}

    def build(order: str) -> None:
        env = {**os.environ, "PATH": os.pathsep.join(orders[order])}
        done = subprocess.run([sys.executable, "-m", "pruneflow.qat.nncf_setup"], cwd=Path(__file__).resolve().parents[1], env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr

    build("activated")  # builds when the cache is cold, else loads
    built, folder = extension_state()
    assert built
    files = sorted(folder.rglob("*.so")) + sorted(folder.rglob("*.o")) + sorted(folder.rglob(".ninja_log"))
    before = {f: f.stat().st_mtime_ns for f in files}
    build("not activated")
    build("activated")
    assert {f: f.stat().st_mtime_ns for f in files} == before, "the extension was rebuilt"
