"""Choosing calibration samples: de-duplication, random, stratified, and diverse (greedy k-center).

Hand-written: onnxruntime, NNCF and OpenVINO all *consume* a calibration set, none chooses one.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from pruneflow.inputs import Inputs


def content_hashes(x: "Inputs") -> list[str]:
    """sha1 of each sample's bytes (dtype and shape included): identical inputs, identical hashes. Several
    inputs: one hash a sample over every input's hash, by name."""
    if isinstance(x, dict):
        per = {k: content_hashes(v) for k, v in x.items()}
        return [hashlib.sha1("".join(f"{k}:{h[i]}" for k, h in per.items()).encode()).hexdigest()
                for i in range(len(next(iter(per.values()))))]
    arr = np.ascontiguousarray(x.detach().cpu().numpy())
    head = f"{arr.dtype}{arr.shape[1:]}".encode()
    return [hashlib.sha1(head + row.tobytes()).hexdigest() for row in arr]


def first_occurrences(hashes: list[str]) -> np.ndarray:
    seen: set[str] = set()
    keep = []
    for i, h in enumerate(hashes):
        if h not in seen:
            seen.add(h)
            keep.append(i)
    return np.asarray(keep, dtype=np.int64)


def select_random(n: int, size: int, seed: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).permutation(n)[:size])


def select_stratified(groups: np.ndarray, size: int, seed: int) -> np.ndarray:
    """Proportional allocation per group (largest remainder), random within each group."""
    rng = np.random.default_rng(seed)
    values, counts = np.unique(groups, return_counts=True)
    size = min(size, len(groups))
    exact = counts / counts.sum() * size
    quota = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - quota), kind="stable")[: size - quota.sum()]:
        quota[i] += 1
    picked = []
    for value, q in zip(values, quota):
        members = np.flatnonzero(groups == value)
        picked.append(rng.permutation(members)[:q])
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)


def select_diverse(features: np.ndarray, size: int, seed: int, refine: int = 10) -> np.ndarray:
    """Greedy k-center, refined by a few k-means steps, then the sample nearest each center.

    Greedy k-center (each pick the sample farthest from all picked so far) spans the extremes of the
    distribution, which is what activation ranges are made of; alone it over-picks outliers and
    leaves dense regions thin. Lloyd steps from those centers move them into the mass while keeping
    every region that k-center found, so the set covers both the tails and the bulk.
    """
    feats = torch.as_tensor(np.asarray(features, dtype=np.float32).reshape(len(features), -1))
    n = len(feats)
    size = min(size, n)
    if size == 0:
        return np.zeros(0, dtype=np.int64)
    first = int(np.random.default_rng(seed).integers(n))
    picked = [first]
    dist = ((feats - feats[first]) ** 2).sum(1)
    for _ in range(size - 1):
        nxt = int(dist.argmax())
        picked.append(nxt)
        dist = torch.minimum(dist, ((feats - feats[nxt]) ** 2).sum(1))
    if not refine or size == n:
        return np.sort(np.asarray(picked, dtype=np.int64))
    centers = feats[torch.as_tensor(picked)].clone()
    for _ in range(refine):
        assign = _nearest(feats, centers)
        sums = torch.zeros_like(centers).index_add_(0, assign, feats)
        counts = torch.bincount(assign, minlength=size).unsqueeze(1)
        centers = torch.where(counts > 0, sums / counts.clamp(min=1), centers)
    order = torch.cdist(centers, feats).argsort(1)
    used: set[int] = set()
    chosen = []
    for row in order:
        for idx in row.tolist():
            if idx not in used:
                used.add(idx)
                chosen.append(idx)
                break
    return np.sort(np.asarray(chosen, dtype=np.int64))


def _nearest(feats: torch.Tensor, centers: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    return torch.cat([torch.cdist(feats[i : i + chunk], centers).argmin(1) for i in range(0, len(feats), chunk)])


def coverage(features: np.ndarray, selected: np.ndarray, chunk: int = 1024, reduce: str = "mean") -> float:
    """Distance from every sample to its nearest selected sample, averaged (or the maximum): lower covers better."""
    feats = torch.as_tensor(np.asarray(features, dtype=np.float32).reshape(len(features), -1))
    centers = feats[torch.as_tensor(selected)]
    nearest = torch.cat([torch.cdist(feats[i : i + chunk], centers).min(1).values for i in range(0, len(feats), chunk)])
    return float(nearest.max() if reduce == "max" else nearest.mean())


LENGTH_EDGES = (8, 16, 32, 64, 128, 256)


def length_buckets(x: "Inputs") -> np.ndarray:
    """One bucket label a sample from its token count (the attention mask's sum): ``1-8``, ``9-16``, ``17-32``,
    ... ``>256``, so ``stratified`` keeps the share of short and long requests a service sees. Raises ValueError
    for inputs without an attention mask (not text)."""
    from pruneflow.inputs import lengths

    n = lengths(x) if isinstance(x, dict) else None
    if n is None:
        raise ValueError("no attention_mask among the inputs: token lengths exist for tokenized text only")
    names = [f"{lo + 1}-{hi}" for lo, hi in zip((0, *LENGTH_EDGES[:-1]), LENGTH_EDGES)] + [f">{LENGTH_EDGES[-1]}"]
    index = np.searchsorted(np.asarray(LENGTH_EDGES), n.cpu().numpy(), side="left")
    return np.asarray(names)[index]
