"""The user cache cannot be steered (issue 41, item 2): generated logs and NNCF's built kernels live in private
folders (0700) of this user's, no link on the way, and a generated folder is reused only while its files are the
ones its record's sha256 names. The clicklog cache used to reuse any folder at its (computable) key that held a
`planted.json`: planted labels made a run exit 0 at accuracy 0.99 instead of 0.82; a linked cache root was followed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path

import pytest

from pruneflow.cache import RECORD, cached_folder, private_dir
from pruneflow.clicklog import cached, write
from pruneflow.errors import InputError
from pruneflow.recipe.models import ClickLogSpec

SPEC = ClickLogSpec(rows=1000, users=50, items=20, seed=3)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "pruneflow"


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """The log SPEC describes, written straight by the generator: what the cache must hand out, byte for byte."""
    folder = tmp_path_factory.mktemp("log")
    write(folder, SPEC.rows, eval_fraction=SPEC.eval_fraction, users=SPEC.users, items=SPEC.items, seed=SPEC.seed)
    return folder


def _same_as_generated(folder: Path, generated: Path) -> None:
    for name in ("train.parquet", "eval.parquet", "planted.json"):
        assert sha(folder / name) == sha(generated / name), name


def test_a_planted_folder_at_the_key_is_generated_again_never_read(cache, generated, caplog):
    first = cached(SPEC)
    key = first.name
    for name in ("train.parquet", "eval.parquet", "planted.json"):  # what a hostile colleague writes at the key
        (first / name).write_bytes(b"planted labels, all clicks")
    (first / RECORD).unlink()
    with caplog.at_level(logging.WARNING, logger="pruneflow"):
        again = cached(SPEC)
    assert again.name == key and b"planted" not in (again / "train.parquet").read_bytes()
    _same_as_generated(again, generated)
    assert "no valid cache.json record" in caplog.text and "generating it again" in caplog.text


@pytest.mark.parametrize("tamper", ["truncated", "extra file", "link", "hard link", "record edited"])
def test_a_folder_whose_files_differ_from_its_record_is_generated_again(cache, generated, tamper, tmp_path):
    folder = cached(SPEC)
    victim = tmp_path / "victim.parquet"
    victim.write_bytes((folder / "eval.parquet").read_bytes())
    if tamper == "truncated":
        (folder / "eval.parquet").write_bytes((folder / "eval.parquet").read_bytes()[:100])
    elif tamper == "extra file":
        (folder / "more.parquet").write_bytes(b"x")
    elif tamper == "link":
        (folder / "eval.parquet").unlink()
        (folder / "eval.parquet").symlink_to(victim)
    elif tamper == "hard link":
        (folder / "eval.parquet").unlink()
        os.link(victim, folder / "eval.parquet")
    else:
        record = json.loads((folder / RECORD).read_text())
        record["files"]["eval.parquet"] = "0" * 64
        (folder / RECORD).write_text(json.dumps(record))
    before = sha(victim)
    again = cached(SPEC)
    _same_as_generated(again, generated)
    assert not (again / "more.parquet").exists() and sha(victim) == before
    assert not (again / "eval.parquet").is_symlink() and (again / "eval.parquet").stat().st_nlink == 1


def test_a_linked_cache_root_is_refused_and_what_it_points_at_is_untouched(cache, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "0000").mkdir(parents=True)
    (elsewhere / "0000" / "planted.json").write_text("{}")
    cache.mkdir(parents=True)
    (cache / "clicklog").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(InputError, match=r"clicklog is a symbolic link") as caught:
        cached(SPEC)
    assert "XDG_CACHE_HOME" in (caught.value.hint or "")
    assert sorted(p.name for p in elsewhere.rglob("*")) == ["0000", "planted.json"]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user's needs root")
def test_a_cache_folder_of_another_user_is_refused(cache):
    (cache / "clicklog").mkdir(parents=True)
    os.chown(cache / "clicklog", 65534, 65534)
    with pytest.raises(InputError, match=r"owned by another user \(uid 65534\)"):
        cached(SPEC)


def test_cache_folders_are_made_private_and_an_open_one_of_ours_is_closed(cache):
    cache.mkdir(parents=True, mode=0o755)
    os.chmod(cache, 0o755)  # as an older pruneflow left it
    folder = cached(SPEC)
    for level in (cache, cache / "clicklog", folder):
        assert stat.S_IMODE(os.lstat(level).st_mode) == 0o700, level
    assert private_dir("clicklog") == cache / "clicklog"


def test_a_concurrent_run_finding_the_folder_made_keeps_the_verified_one(cache):
    calls = []

    def make(folder: Path) -> None:
        calls.append(folder)
        (folder / "data.bin").write_bytes(b"generated")

    first = cached_folder("demo", {"n": 1}, make)
    assert cached_folder("demo", {"n": 1}, make) == first and len(calls) == 1
    assert json.loads((first / RECORD).read_text())["files"] == {"data.bin": hashlib.sha256(b"generated").hexdigest()}


def test_nncf_kernels_folder_with_a_planted_link_is_refused(cache, monkeypatch, tmp_path):
    pytest.importorskip("nncf")
    from pruneflow.qat import nncf_setup

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    folder = nncf_setup.extensions_dir()
    (folder / "nncf").mkdir(parents=True)
    (tmp_path / "evil.so").write_bytes(b"\x7fELF")
    (folder / "nncf" / "quantized_functions_cpu.so").symlink_to(tmp_path / "evil.so")
    with pytest.raises(InputError, match="NNCF's compiled kernels"):
        nncf_setup.configure(notify=lambda message: None)
    assert stat.S_IMODE(os.lstat(cache / "torch_extensions").st_mode) == 0o700


def test_data_files_are_converted_into_the_private_datasets_cache(cache, tmp_path):
    """CSV/JSON/Parquet go through `datasets` into an Arrow cache: pruneflow's own private folder, not a shared one."""
    from pruneflow.data import load_data
    from pruneflow.recipe.models import DataSpec

    rows = ["f0,f1,label"] + [f"{i % 7}.0,{i % 3}.5,{i % 2}" for i in range(40)]
    (tmp_path / "rows.csv").write_text("\n".join(rows) + "\n")
    load_data(DataSpec(format="csv", path=str(tmp_path / "rows.csv"), input_column=["f0", "f1"]), seed=0)
    assert any((cache / "datasets").rglob("*.arrow"))
    assert stat.S_IMODE(os.lstat(cache / "datasets").st_mode) == 0o700
