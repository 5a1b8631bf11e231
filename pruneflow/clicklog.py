"""A deterministic click log with a planted rule: data for rankers whose id tables have 10^6 rows.

    python -m pruneflow.clicklog --rows 1000000 --out runs/data/click-log     # train.parquet + eval.parquet

Each row is an impression: ``user_id`` (Zipf-distributed over ``users`` ids, so a few users are frequent and
most are rare, as in a real log), ``item_id`` (Zipf over ``items``), the item's ``category``, ``device``
(text), ``hour``, and three numbers: ``price`` (log-normal), ``item_age_days`` (exponential), ``user_activity``
(a count). ``clicked`` is drawn from a logistic model planted in the generator: a bias per user and per item,
a user's taste for a category (a dot product of two 4-d vectors), a device and an hour-of-day effect, and
the log price. ``finished`` (the user watched or read the item to its end: a feed's second objective, for a
multi-task ranker) is drawn from a second logistic model that shares the user's taste but has its own item
quality, a user's patience, a device effect of its own, the item's age and the quality of the item's tags.
Two multi-hot columns (lists, for ``data.features.multi_hot`` and an ``nn.EmbeddingBag``): ``item_tags``, the
item's 1-3 tags of 64, and ``recent_categories``, the 1-4 categories the user viewed last (drawn by the user's
taste, so they tell a model what the user likes beyond the one category of the row). AUC therefore means something: the planted logit's own AUC on the eval rows (printed, and
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
    """The log's columns (see the module docstring), plus ``planted_logit`` and ``planted_finish_logit``; a list
    column is an object array of int64 arrays, one a row."""
    columns = _generate(rows, users, items, categories, seed)
    for name, value in columns.items():
        if isinstance(value, tuple):  # (flat values, offsets)
            rows_of = np.empty(rows, dtype=object)
            rows_of[:] = np.split(value[0], value[1][1:-1])
            columns[name] = rows_of
    return columns


def _generate(rows: int, users: int = 1_000_000, items: int = 100_000, categories: int = 200, seed: int = 0) -> dict[str, Any]:
    """``generate``'s columns, a list column as (flat values, offsets), which ``write`` stores without a list a row."""
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
    # drawn after every column above, so they keep their bytes
    tags, tag_count = gen.integers(1, TAGS + 1, (items, 3)), gen.integers(1, 4, items)
    recent = _recent_categories(gen, taste[user], flavour)
    finish = _finish_logit(gen, users, items, user, item, (taste[user] * flavour[category]).sum(1), device, age,
                           _tag_quality(gen, tags, tag_count)[item])
    finished = (gen.random(rows) < 1 / (1 + np.exp(-finish))).astype(np.int64)
    return {"user_id": user.astype(np.int64), "item_id": item.astype(np.int64), "category": category.astype(np.int64),
            "device": DEVICES[device], "hour": hour.astype(np.int64), "price": price, "item_age_days": age,
            "user_activity": activity.astype(np.int64), "clicked": clicked, "finished": finished,
            "item_tags": _ragged(tags[item], tag_count[item]), "recent_categories": recent,
            "planted_logit": logit, "planted_finish_logit": finish}


#: Distinct item tags (ids 1..TAGS).
TAGS = 64


def _ragged(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets): row i holds values[i, :counts[i]]."""
    keep = np.arange(values.shape[1])[None, :] < counts[:, None]
    return values[keep].astype(np.int64), np.r_[0, np.cumsum(counts)].astype(np.int32)


def _tag_quality(gen: np.random.Generator, tags: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Each item's mean tag quality (a planted effect on ``finished``)."""
    quality = gen.normal(0, 0.8, TAGS + 1)
    keep = np.arange(3)[None, :] < count[:, None]
    return (quality[tags] * keep).sum(1) / count


def _recent_categories(gen: np.random.Generator, taste: np.ndarray, flavour: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the 1-4 categories of 8 random candidates that the user's taste (plus Gumbel noise) ranks first."""
    rows = len(taste)
    candidates = gen.integers(0, len(flavour), (rows, 8))
    score = np.einsum("rk,rck->rc", taste.astype(np.float32), flavour[candidates].astype(np.float32))
    score += gen.gumbel(0, 0.5, score.shape).astype(np.float32)
    best = np.take_along_axis(candidates, np.argsort(-score, axis=1)[:, :4], axis=1)
    return _ragged(best, gen.integers(1, 5, rows))


def _finish_logit(gen: np.random.Generator, users: int, items: int, user: np.ndarray, item: np.ndarray, taste: np.ndarray,
                  device: np.ndarray, age: np.ndarray, tag_quality: np.ndarray) -> np.ndarray:
    """The planted log-odds of ``finished``: drawn after every column of the log, so ``clicked`` keeps its bytes."""
    quality, patience = gen.normal(0, 0.9, items), gen.normal(0, 0.7, users)
    return (-0.4 + quality[item] + patience[user] + 0.5 * taste + np.array([0.2, 0.3, -0.4, 0.6, 0.0])[device]
            - 0.004 * age + tag_quality)


def write(out: Path, rows: int, eval_fraction: float = 0.1, **kwargs) -> dict:
    """``train.parquet`` and ``eval.parquet`` (the last ``eval_fraction`` of the rows) under ``out``, and
    ``planted.json`` (the arguments, click rate, and the planted logit's AUC on the eval rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .tasks.binary import auc

    columns = _generate(rows, **kwargs)
    logit = columns.pop("planted_logit")
    finish = columns.pop("planted_finish_logit")
    cut = rows - int(rows * eval_fraction)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", slice(0, cut)), ("eval", slice(cut, rows))):
        table = pa.table({k: _column(v, part, pa) for k, v in columns.items()})
        tmp = out / f".{name}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(out / f"{name}.parquet")
    summary = {"rows": rows, "eval_rows": rows - cut, **kwargs, "click_rate": float(columns["clicked"].mean()),
               "planted_auc_eval": auc(logit[cut:], columns["clicked"][cut:].astype(np.float64)),
               "finish_rate": float(columns["finished"].mean()),
               "planted_finish_auc_eval": auc(finish[cut:], columns["finished"][cut:].astype(np.float64))}
    (out / "planted.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _column(values: Any, part: slice, pa: Any) -> Any:
    """Rows ``part`` of a column: an array, or a list column given as (flat values, offsets)."""
    if not isinstance(values, tuple):
        return values[part]
    flat, offsets = values
    cut = offsets[part.start:(part.stop + 1 if part.stop is not None else None)]
    return pa.ListArray.from_arrays(pa.array(cut - cut[0], pa.int32()), pa.array(flat[cut[0]:cut[-1]]))


#: Rows a row group of a written shard (a streamed epoch shuffles row groups, then rows within its buffer).
ROW_GROUP = 131_072


def write_shards(out: Path, rows: int, shards: int, eval_fraction: float = 0.1, users: int = 1_000_000,
                 items: int = 100_000, categories: int = 200, seed: int = 0) -> dict:
    """The log as Parquet shards, ``train/part-NNNNN.parquet`` (``shards`` of them) and ``eval/part-NNNNN.parquet`` (a
    tenth as many), generated a shard at a time: memory is one shard's, whatever ``rows`` is. The users' and items'
    effects are drawn once from ``seed``, each shard's rows from ``(seed, shard)``; the same arguments give the same
    bytes (not those of ``write``, which draws every row from one generator). ``planted.json`` as ``write`` has it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .tasks.binary import auc

    world = _world(seed, users, items, categories)
    n_eval = int(rows * eval_fraction)
    eval_shards = max(1, shards // 10)
    planted: dict[str, list] = {"logit": [], "clicked": [], "finish": [], "finished": []}
    rates = np.zeros(2)
    for split, count, parts in (("train", rows - n_eval, shards), ("eval", n_eval, eval_shards)):
        (out / split).mkdir(parents=True, exist_ok=True)
        for part in range(parts):
            n = count * (part + 1) // parts - count * part // parts
            columns = _shard_rows(world, np.random.default_rng([seed, 1 + (split == "eval"), part]), n)
            logit, finish = columns.pop("planted_logit"), columns.pop("planted_finish_logit")
            rates += (columns["clicked"].sum(), columns["finished"].sum())
            if split == "eval":
                for key, value in (("logit", logit), ("clicked", columns["clicked"]), ("finish", finish),
                                   ("finished", columns["finished"])):
                    planted[key].append(value)
            table = pa.table({k: _column(v, slice(0, n), pa) for k, v in columns.items()})
            tmp = out / split / f".part-{part:05d}.parquet.tmp"
            pq.write_table(table, tmp, row_group_size=ROW_GROUP)
            tmp.replace(out / split / f"part-{part:05d}.parquet")
    cat = {k: np.concatenate(v) for k, v in planted.items()}
    summary = {"rows": rows, "eval_rows": n_eval, "shards": shards, "eval_shards": eval_shards, "users": users,
               "items": items, "seed": seed, "click_rate": float(rates[0] / rows), "finish_rate": float(rates[1] / rows),
               "planted_auc_eval": auc(cat["logit"], cat["clicked"].astype(np.float64)),
               "planted_finish_auc_eval": auc(cat["finish"], cat["finished"].astype(np.float64))}
    (out / "planted.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _world(seed: int, users: int, items: int, categories: int) -> dict[str, np.ndarray]:
    """What every shard of a sharded log shares: the users' and items' planted effects and id popularity."""
    gen = np.random.default_rng([seed, 0])
    tags, tag_count = gen.integers(1, TAGS + 1, (items, 3)), gen.integers(1, 4, items)
    popularity = {}
    for name, count, exponent in (("user", users, 0.9), ("item", items, 1.0)):
        weights = np.arange(1, count + 1, dtype=np.float64) ** -exponent
        popularity[name + "_cdf"], popularity[name + "_perm"] = np.cumsum(weights / weights.sum()), gen.permutation(count)
    return {"user_bias": gen.normal(0, 0.8, users), "item_bias": gen.normal(0, 0.6, items),
            "taste": gen.normal(0, 0.6, (users, 4)), "flavour": gen.normal(0, 0.6, (categories, 4)),
            "item_category": gen.integers(0, categories, items), "tags": tags, "tag_count": tag_count,
            "tag_quality": _tag_quality(gen, tags, tag_count), "quality": gen.normal(0, 0.9, items),
            "patience": gen.normal(0, 0.7, users), **popularity}


def _shard_rows(world: dict[str, np.ndarray], gen: np.random.Generator, rows: int) -> dict[str, Any]:
    """One shard's rows: ``_generate``'s model, with the world's effects fixed."""
    def zipf(name: str) -> np.ndarray:
        cdf = world[name + "_cdf"]
        return world[name + "_perm"][np.minimum(np.searchsorted(cdf, gen.random(rows)), len(cdf) - 1)]

    user, item = zipf("user"), zipf("item")
    category = world["item_category"][item]
    device, hour = gen.integers(0, len(DEVICES), rows), gen.integers(0, 24, rows)
    price, age = np.exp(gen.normal(3.0, 1.0, rows)).round(2), gen.exponential(30.0, rows).round(1)
    activity = gen.poisson(5.0, rows) + (user % 7)
    taste = (world["taste"][user] * world["flavour"][category]).sum(1)
    logit = (-1.6 + world["user_bias"][user] + world["item_bias"][item] + taste
             + np.array([0.3, 0.1, -0.2, -0.5, 0.0])[device] + 0.4 * np.sin(hour / 24 * 2 * np.pi)
             - 0.25 * (np.log(price) - 3.0) - 0.01 * age + 0.03 * activity)
    clicked = (gen.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    recent = _recent_categories(gen, world["taste"][user], world["flavour"])
    finish = (-0.4 + world["quality"][item] + world["patience"][user] + 0.5 * taste
              + np.array([0.2, 0.3, -0.4, 0.6, 0.0])[device] - 0.004 * age + world["tag_quality"][item])
    finished = (gen.random(rows) < 1 / (1 + np.exp(-finish))).astype(np.int64)
    return {"user_id": user.astype(np.int64), "item_id": item.astype(np.int64), "category": category.astype(np.int64),
            "device": DEVICES[device], "hour": hour.astype(np.int64), "price": price, "item_age_days": age,
            "user_activity": activity.astype(np.int64), "clicked": clicked, "finished": finished,
            "item_tags": _ragged(world["tags"][item], world["tag_count"][item]), "recent_categories": recent,
            "planted_logit": logit, "planted_finish_logit": finish}


def cached(spec: Any, kind: str = "clicklog", writer: "Callable[[Path, Any], Any] | None" = None) -> Path:
    """The folder of the log ``spec`` (``recipe.models.ClickLogSpec``) describes, generated on first use into the user
    cache and reused after (deterministic: one folder per settings), only while its files are the ones generated
    (``cache.cached_folder``: a private folder, each file's sha256 in its record; a planted or altered folder is
    generated again, never read). ``kind`` and ``writer(folder, spec)`` serve another generated log the same way
    (``pruneflow.seqlog``)."""
    from .cache import cached_folder

    settings = spec.model_dump(exclude_none=True) | ({"columns": 3} if kind == "clicklog" else {})  # 3: finished, item_tags, recent_categories

    def make(folder: Path) -> None:
        if writer is not None:
            writer(folder, spec)
        elif getattr(spec, "shards", None):
            write_shards(folder, spec.rows, spec.shards, eval_fraction=spec.eval_fraction, users=spec.users,
                         items=spec.items, seed=spec.seed)
        else:
            write(folder, spec.rows, eval_fraction=spec.eval_fraction, users=spec.users, items=spec.items, seed=spec.seed)

    return cached_folder(kind, settings, make)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pruneflow.clicklog", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=1_000_000)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=0, help="write train/part-*.parquet and eval/part-*.parquet "
                        "shards, a shard at a time (bounded memory), instead of one file a split")
    parser.add_argument("--out", type=Path, required=True, help="folder for train.parquet, eval.parquet, planted.json")
    args = parser.parse_args(argv)
    kwargs = {"users": args.users, "items": args.items, "seed": args.seed}
    summary = write_shards(args.out, args.rows, args.shards, **kwargs) if args.shards else write(args.out, args.rows, **kwargs)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
