"""Write a request log as a text-classification service would keep one: a jsonl file, one request a line,
``{"text": "...", "ts": "2026-11-30T09:00:01.250Z"}``, no labels. The calibrate stage of
recipes/minilm-sst2.yaml reads it (`source: {format: jsonl, path: ..., input_column: text}`).

The sentences are SST-2 train phrases (../shared/data/sst2/train.parquet), drawn at random with a seed and
stripped of GLUE's trailing space; the timestamps are synthetic (one request every 0.1-2 s from a fixed
start), there only so the file looks like what a service writes. Written atomically; never committed
(the default path is under runs/, which git ignores).

    python benchmarks/make_request_log.py                              # runs/requests/sst2-requests.jsonl
    python benchmarks/make_request_log.py --count 500 --out /tmp/requests.jsonl --seed 1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pruneflow.artifacts import write_text_atomic  # noqa: E402

SOURCE = REPO.parent / "shared" / "data" / "sst2" / "train.parquet"
OUT = REPO / "runs" / "requests" / "sst2-requests.jsonl"
START = dt.datetime(2026, 11, 30, 9, 0, 0, tzinfo=dt.timezone.utc)


def request_lines(sentences: list[str], count: int, seed: int) -> list[str]:
    """``count`` jsonl lines of randomly drawn ``sentences`` (without replacement while they last) with
    increasing synthetic timestamps."""
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(sentences), size=count, replace=count > len(sentences))
    gaps = rng.uniform(0.1, 2.0, size=count).cumsum()
    lines = []
    for i, gap in zip(picked, gaps):
        ts = (START + dt.timedelta(seconds=float(gap))).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        lines.append(json.dumps({"text": sentences[int(i)].strip(), "ts": ts}))
    return lines


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="SST-2 train parquet (column `sentence`)")
    parser.add_argument("--out", type=Path, default=OUT, help="jsonl file to write")
    parser.add_argument("--count", type=int, default=2000, help="requests to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be at least 1")
    if not args.source.is_file():
        parser.error(f"--source {args.source} not found (../shared/data/sst2 beside the checkout)")
    import pyarrow.parquet as pq

    sentences = pq.read_table(args.source, columns=["sentence"]).column("sentence").to_pylist()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, "\n".join(request_lines(sentences, args.count, args.seed)) + "\n")
    print(f"{args.count} requests -> {args.out}")
    return args.out


if __name__ == "__main__":
    main()
