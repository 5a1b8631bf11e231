"""A deterministic interaction log with a planted rule: data for sequential recommenders (SASRec, GRU4Rec).

    python -m pruneflow.seqlog --rows 100000 --items 20000 --out runs/data/seq-log   # train.parquet + eval.parquet

No registry package ships a real interaction log (MovieLens, Amazon reviews, RetailRocket are downloads), so the
log is generated, with a rule a model can learn and a ceiling to read it against. Each row is one user's last
``length`` items, oldest first (``seq``, int64, left-padded with 0 when the history is shorter), and the item that
came next (``next_item``). Items ``1..items-1`` fall into ``topics``; popularity within a topic is Zipf. A user
moves from item ``i`` to:

- its *successor* ``s(i)`` (a fixed random pairing, as the next episode of a series) with probability ``follow``;
- else a popular item of the topic that follows ``i``'s in a fixed chain of topics, with probability ``stay``;
- else a popular item of the user's favourite topic.

The successors are memorised item by item (a model needs to see ``i`` followed often enough); the topic chain and
the popularity are shared structure a model learns from every row.

The planted distribution's own top-k hit rate on the eval rows (``planted.json``: ``planted_hr@10``) is the
ceiling a model can approach; a model that learns only popularity reaches a small share of it, one that learns the
successors and topics most of it. Everything comes from one seed: the same arguments give the same bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


class _Catalogue:
    """Topics, Zipf popularity within each topic, and the successor pairing."""

    def __init__(self, gen: np.random.Generator, items: int, topics: int):
        self.items, self.topics = items, topics
        self.topic = gen.integers(0, topics, items)
        self.topic[0] = -1  # row 0 is padding, never an item
        self.successor = np.zeros(items, dtype=np.int64)
        order = gen.permutation(np.arange(1, items))
        self.successor[order] = np.roll(order, -1)  # one cycle through every item
        self.next_topic = gen.permutation(topics)
        self.members = [np.flatnonzero(self.topic == t) for t in range(topics)]
        self.weights = []
        for m in self.members:
            w = np.arange(1, len(m) + 1, dtype=np.float64) ** -1.1
            self.weights.append(np.cumsum(w / w.sum()))

    def popular(self, gen: np.random.Generator, topics: np.ndarray) -> np.ndarray:
        """One Zipf-popular item of each row's topic."""
        out = np.empty(len(topics), dtype=np.int64)
        for t in np.unique(topics):
            rows = np.flatnonzero(topics == t)
            cdf = self.weights[t]
            out[rows] = self.members[t][np.minimum(np.searchsorted(cdf, gen.random(len(rows))), len(cdf) - 1)]
        return out

    def probabilities(self, last: np.ndarray, favourite: np.ndarray, follow: float, stay: float) -> np.ndarray:
        """The planted next-item distribution of each row ``[rows, items]`` (for the ceiling; small eval sets only)."""
        p = np.zeros((len(last), self.items))
        p[np.arange(len(last)), self.successor[last]] += follow
        for share, topics in ((stay * (1 - follow), self.next_topic[self.topic[last]]), ((1 - stay) * (1 - follow), favourite)):
            for t in np.unique(topics):
                rows = np.flatnonzero(topics == t)
                pmf = np.diff(np.r_[0.0, self.weights[t]])
                p[np.ix_(rows, self.members[t])] += share * pmf
        return p


def generate(rows: int, items: int = 20_000, topics: int = 100, length: int = 20, follow: float = 0.5, stay: float = 0.6,
             seed: int = 0) -> tuple[dict[str, np.ndarray], _Catalogue, np.ndarray]:
    """The log's columns (``seq`` [rows, length], ``next_item`` [rows], ``history`` [rows]: real items in ``seq``), the
    catalogue, and each row's favourite topic."""
    gen = np.random.default_rng(seed)
    cat = _Catalogue(gen, items, topics)
    favourite = gen.integers(0, topics, rows)
    walk = np.zeros((rows, length + 1), dtype=np.int64)
    walk[:, 0] = cat.popular(gen, favourite)
    for step in range(1, length + 1):
        prev = walk[:, step - 1]
        draw = gen.random(rows)
        topic = np.where(gen.random(rows) < stay, cat.next_topic[cat.topic[prev]], favourite)
        walk[:, step] = np.where(draw < follow, cat.successor[prev], cat.popular(gen, topic))
    history = gen.integers(3, length + 1, rows)  # users with short histories: the seq is left-padded with 0
    seq = walk[:, :length].copy()
    seq[np.arange(length)[None, :] < (length - history)[:, None]] = 0
    return {"seq": seq, "next_item": walk[:, length], "history": history}, cat, favourite


def planted_hit_rate(cat: _Catalogue, seq: np.ndarray, target: np.ndarray, favourite: np.ndarray, follow: float,
                     stay: float, k: int = 10, chunk: int = 512) -> float:
    """HR@k of the planted distribution itself: the ceiling of any model on these rows."""
    hits = 0
    for start in range(0, len(seq), chunk):
        part = slice(start, start + chunk)
        p = cat.probabilities(seq[part, -1], favourite[part], follow, stay)
        top = np.argpartition(-p, k, axis=1)[:, :k]
        hits += int((top == target[part, None]).any(1).sum())
    return hits / max(len(seq), 1)


def write(out: Path, rows: int, eval_fraction: float = 0.1, items: int = 20_000, topics: int = 100, length: int = 20,
          seed: int = 0) -> dict:
    """``train.parquet`` and ``eval.parquet`` (the last ``eval_fraction`` of the rows) under ``out``, and
    ``planted.json`` (the arguments and the planted distribution's HR@10 on the eval rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    follow, stay = 0.35, 0.7
    columns, cat, favourite = generate(rows, items, topics, length, follow, stay, seed)
    cut = rows - int(rows * eval_fraction)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", slice(0, cut)), ("eval", slice(cut, rows))):
        table = pa.table({"seq": pa.array(list(columns["seq"][part]), type=pa.list_(pa.int64(), length)),
                          "next_item": columns["next_item"][part], "history": columns["history"][part]})
        tmp = out / f".{name}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(out / f"{name}.parquet")
    hr = planted_hit_rate(cat, columns["seq"][cut:], columns["next_item"][cut:], favourite[cut:], follow, stay)
    summary = {"rows": rows, "eval_rows": rows - cut, "items": items, "topics": topics, "length": length, "seed": seed,
               "follow": follow, "stay": stay, "planted_hr@10_eval": hr}
    (out / "planted.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_spec(out: Path, spec) -> dict:
    """``write`` with the settings of a recipe's ``data.seqlog`` (``recipe.models.SeqLogSpec``)."""
    return write(out, spec.rows, eval_fraction=spec.eval_fraction, items=spec.items, topics=spec.topics,
                 length=spec.length, seed=spec.seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pruneflow.seqlog", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--topics", type=int, default=100)
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="folder for train.parquet, eval.parquet, planted.json")
    args = parser.parse_args(argv)
    print(json.dumps(write(args.out, args.rows, items=args.items, topics=args.topics, length=args.length, seed=args.seed),
                     indent=2))


if __name__ == "__main__":
    main()
