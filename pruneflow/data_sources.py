"""Reading one data source into a ``datasets.Dataset``: files and folders of csv/json/parquet, npz arrays,
imagefolder and ``save_to_disk`` folders, checked to be regular files that hold rows (moved out of ``data.py``,
which splits and preprocesses what these return).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import InputError, MissingDependencyError

EVAL_SPLIT_NAMES = ("validation", "eval", "test", "valid")


def _check_regular(p: Path, field_name: str) -> None:
    """A data source is a regular file or a folder: a FIFO blocked the run forever with no output, and a device
    such as /dev/zero grew until the process was killed (issue 27). Reading a folder's files, each is checked."""
    import stat

    paths = [p] if not p.is_dir() else [f for f in p.iterdir() if not f.name.startswith(".")]
    for f in paths:
        try:
            mode = f.stat().st_mode  # through a link: what is read is what counts
        except OSError:
            continue  # a dangling link in a folder: the loader names what it cannot read
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket"
            raise InputError(f"{field_name}: {f} is {kind}, not a file: data is read from regular files only",
                             hint="point at a file (or a folder of files) on disk")


def load_source(fmt: str, path: str, field_name: str):
    """Returns (Dataset, class_names) or ((train, eval), class_names) for a split save_to_disk folder."""
    import datasets

    p = Path(path)
    if not p.exists():
        raise InputError(f"{field_name}: file not found: {p}", hint="paths are relative to the recipe file")
    _check_regular(p, field_name)
    class_names = None
    try:
        if fmt == "npz":
            ds, class_names = _npz(p)
        elif fmt in ("csv", "json", "parquet"):
            files = sorted(str(f) for f in p.glob(f"*.{fmt}*")) if p.is_dir() else [str(p)]
            if not files:
                raise InputError(f"{field_name}: no *.{fmt} files in folder {p}", hint=f"point at a .{fmt} file or a folder holding some")
            try:
                ds = datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=_arrow_cache())
            except Exception:
                # datasets fails with unrelated messages on files that hold no rows (header-only csv, 0-row parquet)
                if _holds_no_rows(fmt, files):
                    raise InputError(f"{field_name}: {p} holds no rows (empty dataset)", hint="point at a file with samples in it") from None
                raise
        elif fmt == "imagefolder":
            try:
                import PIL  # noqa: F401
            except ImportError as exc:
                raise MissingDependencyError("imagefolder data needs Pillow", hint="pip install pillow") from exc
            ds = datasets.load_dataset("imagefolder", data_dir=str(p), split="train", cache_dir=_arrow_cache())
        elif fmt == "disk":
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                evals = [n for n in EVAL_SPLIT_NAMES if n in ds]
                if "train" in ds and evals and field_name == "data.path":
                    return (ds["train"], ds[evals[0]]), None
                if len(ds) == 1:
                    ds = next(iter(ds.values()))
                else:
                    expected = f"`train` plus one of {', '.join(EVAL_SPLIT_NAMES)}" if field_name == "data.path" else "a single split"
                    raise InputError(
                        f"{field_name}: {p} holds splits {list(ds)}; expected {expected}",
                        hint="point data.train and data.eval at single-split folders instead",
                    )
        else:  # pragma: no cover - the recipe model restricts formats
            raise InputError(f"unknown data format {fmt!r}", hint="data.format: npz, csv, json, parquet, imagefolder or disk")
    except (InputError, MissingDependencyError):
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for unreadable files
        raise InputError(f"{field_name}: could not read {p} as {fmt}: {type(exc).__name__}: {exc}",
                         hint=f"check that {p} is {fmt} data, or set data.format to what it holds (npz, csv, json, parquet, "
                         "imagefolder, disk: a datasets save_to_disk folder)") from exc
    if len(ds) == 0:
        raise InputError(f"{field_name}: {p} holds no rows (empty dataset)", hint="point at a file with samples in it")
    return ds, class_names


def _arrow_cache() -> str:
    """Where ``datasets`` keeps the Arrow copies of data files: the user cache's private ``datasets`` folder (0700, this
    user's, no link on the way: ``cache.private_dir``), not a shared one another user could fill."""
    from .cache import private_dir

    return str(private_dir("datasets"))


def _holds_no_rows(fmt: str, files: list[str]) -> bool:
    """True when every file is blank, a csv header alone, an empty json list or a 0-row parquet."""
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return all(pq.ParquetFile(f).metadata.num_rows == 0 for f in files)
        if any(Path(f).stat().st_size > 1 << 20 for f in files):  # a megabyte of text holds rows; never read it all here
            return False
        texts = [Path(f).read_text(errors="replace").strip() for f in files]
        if fmt == "csv":
            return all(len(t.splitlines()) <= 1 for t in texts)
        return all(t in ("", "[]") for t in texts)
    except Exception:  # noqa: BLE001 - unreadable: let the original error speak
        return False


def _check_npz_fits(path: Path) -> None:
    """An .npz is read whole into memory: what its members hold once inflated (from the zip's own directory,
    nothing decompressed) must leave room, or a small file that inflates to more than the machine has (by accident
    or on purpose) is refused (exit 2) instead of killing the run."""
    import zipfile

    from .config import memory_left

    try:
        with zipfile.ZipFile(path) as archive:
            inflated = sum(info.file_size for info in archive.infolist())
    except (OSError, zipfile.BadZipFile):
        return  # not a zip (a plain .npy, a corrupt file): np.load names the problem
    free, where = memory_left()
    if free is not None and inflated > free // 2:
        raise InputError(f"{path} holds {inflated / 1e9:,.2f} GB of arrays once read, and there are "
                         f"{free / 1e9:,.2f} GB {where.removeprefix('available ')}: an .npz is read whole into memory",
                         hint="split it, or convert it to parquet (read in pieces): data.format: parquet")


def _npz(path: Path):
    import datasets

    _check_npz_fits(path)
    arrays = dict(np.load(path, allow_pickle=False))
    if not arrays:
        raise InputError(f"data: {path} holds no arrays", hint="write it with np.savez(path, x=inputs, y=labels) and name the keys "
                         "in data.input_column and data.label_column")
    class_names = None
    if "class_names" in arrays:
        class_names = [str(n) for n in arrays.pop("class_names")]
    n = max(a.shape[0] for a in arrays.values() if a.ndim)
    columns = {k: a for k, a in arrays.items() if a.ndim and a.shape[0] == n}
    # ArrayND features keep multi-dimensional arrays columnar; nested lists are ~100x slower to read back.
    array_types = {2: datasets.Array2D, 3: datasets.Array3D, 4: datasets.Array4D, 5: datasets.Array5D}
    features = {}
    for key, arr in columns.items():
        shape, dtype = arr.shape[1:], str(arr.dtype)
        if not shape:
            features[key] = datasets.Value(dtype)
        elif len(shape) == 1:
            features[key] = datasets.List(datasets.Value(dtype), length=shape[0])
        elif len(shape) in array_types:
            features[key] = array_types[len(shape)](shape, dtype)
        else:
            raise InputError(f"data: array {key!r} in {path} has {arr.ndim} dimensions; at most 6 are supported",
                             hint="merge trailing axes before saving (samples first, at most 5 more) and reshape them back in "
                             "the model's forward")
    return datasets.Dataset.from_dict(columns, features=datasets.Features(features)), class_names
