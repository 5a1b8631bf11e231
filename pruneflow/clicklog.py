"""A deterministic click log with a planted rule: data for rankers whose id tables have 10^6 rows.

    python -m pruneflow.clicklog --rows 1000000 --out runs/data/click-log     # train.parquet + eval.parquet

Each row is an impression: ``user_id`` (Zipf-distributed over ``users`` ids, so a few users are frequent and
most are rare, as in a real log), ``item_id`` (Zipf over ``items``), the item's ``category``, ``device``
(text), ``hour``, and three numbers: ``price`` (log-normal), ``item_age_days`` (exponential), ``user_activity``
(a count). ``clicked`` is drawn from a logistic model planted in the generator: a bias per user and per item,
a user's taste for a category (a dot product of two 4-d vectors), a device and an hour-of-day effect, and
the log price. AUC therefore means something: the planted logit's own AUC on the eval rows (printed, and
written to ``planted.json``) is the ceiling a model can approach, and a model that ignores the user table
loses most of the per-user part. Everything comes from one seed: the same arguments give the same bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

DEVICES = np.array(["android", "ios", "web", "tv", "other"])


def _zipf_ids(gen: np.random.Generator, n: int, count: int, exponent: float) -> np.ndarray:
    """``n`` ids in ``0..count-1``, id k drawn with probability proportional to (k + 1) ** -exponent, then permuted
    (a frequent id is not a small number)."""
    weights = np.arange(1, count + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights / weights.sum())
    ranks = np.minimum(np.searchsorted(cdf, gen.random(n)), count - 1)
    return gen.permutation(count)[ranks]


def generate(rows: int, users: int = 1_000_000, items: int = 100_000, categories: int = 200, seed: int = 0) -> dict[str, np.ndarray]:
    """The log's columns (see the module docstring), plus ``planted_logit``."""
    gen = np.random.default_rng(seed)
    user_bias, item_bias = gen.normal(0, 0.8, users), gen.normal(0, 0.6, items)
    taste, flavour = gen.normal(0, 0.6, (users, 4)), gen.normal(0, 0.6, (categories, 4))
    item_category = gen.integers(0, categories, items)
    user = _zipf_ids(gen, rows, users, 0.9)
    item = _zipf_ids(gen, rows, items, 1.0)
    category = item_category[item]
    device = gen.integers(0, len(DEVICES), rows)
    hour = gen.integers(0, 24, rows)
    price = np.exp(gen.normal(3.0, 1.0, rows)).round(2)
    age = gen.exponential(30.0, rows).round(1)
    activity = gen.poisson(5.0, rows) + (user % 7)
    logit = (-1.6 + user_bias[user] + item_bias[item] + (taste[user] * flavour[category]).sum(1)
             + np.array([0.3, 0.1, -0.2, -0.5, 0.0])[device] + 0.4 * np.sin(hour / 24 * 2 * np.pi)
             - 0.25 * (np.log(price) - 3.0) - 0.01 * age + 0.03 * activity)
    clicked = (gen.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    return {"user_id": user.astype(np.int64), "item_id": item.astype(np.int64), "category": category.astype(np.int64),
            "device": DEVICES[device], "hour": hour.astype(np.int64), "price": price, "item_age_days": age,
            "user_activity": activity.astype(np.int64), "clicked": clicked, "planted_logit": logit}


def write(out: Path, rows: int, eval_fraction: float = 0.1, **kwargs) -> dict:
    """``train.parquet`` and ``eval.parquet`` (the last ``eval_fraction`` of the rows) under ``out``, and
    ``planted.json`` (the arguments, click rate, and the planted logit's AUC on the eval rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .tasks.binary import auc

    columns = generate(rows, **kwargs)
    logit = columns.pop("planted_logit")
    cut = rows - int(rows * eval_fraction)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", slice(0, cut)), ("eval", slice(cut, rows))):
        table = pa.table({k: v[part] for k, v in columns.items()})
        tmp = out / f".{name}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(out / f"{name}.parquet")
    summary = {"rows": rows, "eval_rows": rows - cut, **kwargs, "click_rate": float(columns["clicked"].mean()),
               "planted_auc_eval": auc(logit[cut:], columns["clicked"][cut:].astype(np.float64))}
    (out / "planted.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def cached(spec: Any, kind: str = "clicklog", writer: "Callable[[Path, Any], Any] | None" = None) -> Path:
    """The folder of the log ``spec`` (``recipe.models.ClickLogSpec``) describes, generated on first use into the user
    cache and reused after (deterministic: one folder per settings). Written beside, then renamed into place, so a
    run killed mid-write or a concurrent one never reads half a log. ``kind`` and ``writer(folder, spec)`` serve
    another generated log the same way (``pruneflow.seqlog``)."""
    import hashlib
    import os
    import shutil
    import tempfile

    settings = spec.model_dump()
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pruneflow" / kind
    folder = root / key
    if (folder / "planted.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        if writer is not None:
            writer(tmp, spec)
        else:
            write(tmp, spec.rows, eval_fraction=spec.eval_fraction, users=spec.users, items=spec.items, seed=spec.seed)
        try:
            tmp.rename(folder)
        except OSError:  # another run made it meanwhile: its copy is the same bytes
            if not (folder / "planted.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pruneflow.clicklog", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="folder for train.parquet, eval.parquet, planted.json")
    args = parser.parse_args(argv)
    print(json.dumps(write(args.out, args.rows, users=args.users, items=args.items, seed=args.seed), indent=2))


if __name__ == "__main__":
    main()
