"""Embedding-table pruning (`granularity: tables`): rows merged into one row, table widths cut by a weighted SVD.

In a ranker the id tables are nearly all the bytes (a DeepFM over a 10^6-row click log: 99.9 %), and most of
their rows are seldom read: a hashed user id space is mostly buckets that training saw once or never (a row never
read keeps its random initialisation, noise that any new id hashing there is scored with). Two removals, both
judged on how often the training split reads each row (counted by running the model over the whole split with a
hook on every table, so shared tables, offsets and custom lookups are counted as the model reads them):

- **Rows.** The least-read rows of all candidate tables together (never-read rows always) are merged into one row
  per table, row 0 of the compacted table, holding the read-weighted mean of what it replaces: the *merged row*,
  the out-of-vocabulary row of the rows that go. An ``index`` (int32, one entry per original row) maps an id to
  its compacted row; ids and the deployment record stay as they are.
- **Dimensions.** A table ``T`` (rows x d) becomes ``A @ B.T`` with ``B`` (d x r) the top ``r`` eigenvectors of
  ``T.T @ diag(reads + 1) @ T``: the rank-r table closest to ``T`` in squared error weighted by how often each row
  is read (a weighted SVD). The model still sees d columns (a factorisation machine's dot products and the MLP
  need them); the table stores r. Ranks are allocated across tables by each direction's share of its table's
  weighted energy: the globally least are dropped first (mixed-dimension embeddings, Ginart et al. 2019, with
  the projection found by SVD instead of trained).

Written by hand: torch-pruning prunes a table's columns together with every layer that reads them (for a
DeepFM, all of them), never rows; NNCF has no embedding pruning. Tables under ``min_rows`` rows are left whole
(a small vocabulary's rows each carry a category, and factoring a small table adds bytes).

``nn.EmbeddingBag`` tables (multi-hot fields: ``zoo/bags.py``) are left whole, and the stage says so
(``bag_note``): a compacted table is an ``nn.Embedding`` (``CompactEmbedding``) whose ``index`` remaps ids one by
one, and a bag table would need its own class that keeps its padding row out of the merge, its ``mode`` and
its ``per_sample_weights``, counts the reads of its non-padding ids only, and that the export's bag rewrite
(``export/bags.py``) knows. Not written yet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..evaluate import count_macs_params
from ..inputs import Inputs, call, size, take, to
from .catalogue import label_counts, merge_output_rows, output_count, output_projection, output_rows, rows_to_merge
from .observe import observing
from .rounds import Batches, Plan, Round, Strategy

#: Samples a counting forward pass reads at once.
COUNT_BATCH = 8192
#: The key of the output projection's label counts among the tables' read counts.
OUTPUTS = "<outputs>"


class CompactEmbedding(nn.Embedding):
    """A pruned table: ``weight`` holds the kept rows (row 0: the merged row) of ``embedding_dim`` columns;
    ``index`` maps each of the ``source_rows`` original ids to its row; ``projection`` (out_dim x embedding_dim,
    or empty when the width was kept) maps a row back to the ``out_dim`` columns the model reads.

    A subclass of ``nn.Embedding``, so what treats tables as tables (NNCF leaving them out, the int8 row grid,
    the export's row-wise Gather rewrite, channel pruning keeping them whole) treats this one so too.
    """

    def __init__(self, weight: torch.Tensor, index: torch.Tensor, projection: torch.Tensor | None = None):
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight.detach().clone())
        self.source_rows = int(index.numel())
        self.out_dim = int(projection.shape[0]) if projection is not None else int(weight.shape[1])
        self.projected = projection is not None  # a plain attribute: export traces one path, a checkpoint restores it
        self.index: torch.Tensor
        self.register_buffer("index", index.to(torch.int32).clone())
        empty = torch.zeros(0, 0, dtype=weight.dtype, device=weight.device)
        self.projection = nn.Parameter(projection.detach().clone() if projection is not None else empty)

    @classmethod
    def blank(cls) -> "CompactEmbedding":
        """One whose sizes a checkpoint sets (registered under ``pruneflow.rebuildable_modules``)."""
        return cls(torch.zeros(1, 1), torch.zeros(1, dtype=torch.int32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(self.index[ids], self.weight)
        return F.linear(rows, self.projection) if self.projected else rows

    def dense(self) -> torch.Tensor:
        """The table as the model reads it: ``source_rows`` x ``out_dim``."""
        rows = F.linear(self.weight, self.projection) if self.projected else self.weight
        return rows[self.index.long()]

    def extra_repr(self) -> str:
        width = f"{self.embedding_dim} -> {self.out_dim}" if self.projected else f"{self.embedding_dim}"
        return f"{self.source_rows} ids -> {self.num_embeddings} rows, {width} columns"


def candidate_tables(model: nn.Module, min_rows: int, ignored: tuple[str, ...] = ()) -> list[str]:
    """Names of the ``nn.Embedding`` tables of at least ``min_rows`` (original) rows, not ``ignored`` (never an
    ``nn.EmbeddingBag``: ``bag_note``)."""
    out = []
    for name, module in model.named_modules():
        if type(module) not in (nn.Embedding, CompactEmbedding) or any(name == i or name.startswith(i + ".") for i in ignored):
            continue
        if source_rows(module) >= min_rows:
            out.append(name)
    return out


def bag_note(model: nn.Module) -> str | None:
    """Why the model's ``nn.EmbeddingBag`` tables stay whole (None: it has none)."""
    bags = [f"{n} ({m.num_embeddings} rows)" for n, m in model.named_modules() if isinstance(m, nn.EmbeddingBag)]
    if not bags:
        return None
    return (f"{len(bags)} nn.EmbeddingBag table(s) left whole ({', '.join(bags[:4])}{', ...' if len(bags) > 4 else ''}): "
            "`granularity: tables` merges rows of nn.Embedding tables only (a merged bag table must keep its padding "
            "row and mode, which no compacted table class does yet)")


def tables_of(model: nn.Module, names: list[str]) -> dict[str, nn.Embedding]:
    """The named tables of ``model`` (each an ``nn.Embedding``, compacted or not)."""
    out = {}
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module, nn.Embedding)  # candidate_tables chose it, and compaction keeps the class
        out[name] = module
    return out


def source_rows(module: nn.Embedding) -> int:
    return module.source_rows if isinstance(module, CompactEmbedding) else module.num_embeddings


def out_width(module: nn.Embedding) -> int:
    return module.out_dim if isinstance(module, CompactEmbedding) else module.embedding_dim


def rank(module: nn.Embedding) -> int:
    """Columns the table stores a row with."""
    return module.embedding_dim


def table_bytes(module: nn.Embedding) -> int:
    """FP32 bytes of a table as stored: its rows, plus the index and projection of a compacted one."""
    size = module.weight.numel() * 4
    if isinstance(module, CompactEmbedding):
        size += module.index.numel() * 4 + module.projection.numel() * 4
    return size


@torch.no_grad()
def count_reads(model: nn.Module, names: list[str], x: Inputs, device: str, batch: int = COUNT_BATCH) -> dict[str, torch.Tensor]:
    """How often each stored row of each named table is read when ``model`` runs over ``x`` (eval mode)."""
    modules = tables_of(model, names)
    counts = {n: torch.zeros(m.num_embeddings, dtype=torch.float64) for n, m in modules.items()}

    def hook(name: str) -> Callable:
        def record(module, args) -> None:
            ids = args[0]
            if isinstance(module, CompactEmbedding):
                ids = module.index[ids]
            counts[name] += torch.bincount(ids.reshape(-1).long().cpu(), minlength=module.num_embeddings).double()
        return record

    with observing(model, [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]):
        for start in range(0, size(x), batch):
            call(model, to(take(x, slice(start, start + batch)), device))
    return counts


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def rows_to_remove(modules: dict[str, nn.Embedding], counts: dict[str, torch.Tensor], remove: int) -> dict[str, np.ndarray]:
    """Per table, a mask of the stored rows to merge: the ``remove`` least-read rows of all tables together, and
    every row never read (ties: the smaller row norm first). A compacted table's merged row (row 0) stays."""
    keys, order_rows, order_tables = [], [], []
    for t, (name, module) in enumerate(modules.items()):
        reads = counts[name].numpy().copy()
        if isinstance(module, CompactEmbedding):
            reads[0] = np.inf  # the merged row: where the others go
        norms = module.weight.detach().float().norm(dim=1).cpu().numpy()
        keys.append(np.stack([reads, norms]))
        order_rows.append(np.arange(len(reads)))
        order_tables.append(np.full(len(reads), t))
    reads, norms = np.concatenate(keys, axis=1)
    rows, tables = np.concatenate(order_rows), np.concatenate(order_tables)
    order = np.lexsort((norms, reads))  # least read first; among equals, the smaller row
    chosen = order[: max(remove, int((reads == 0).sum()))]
    masks = {name: np.zeros(m.num_embeddings, dtype=bool) for name, m in modules.items()}
    names = list(modules)
    for t in np.unique(tables[chosen]):
        masks[names[t]][rows[chosen[tables[chosen] == t]]] = True
    return masks


@torch.no_grad()
def merge_rows(module: nn.Embedding, merged: np.ndarray, reads: torch.Tensor) -> tuple[CompactEmbedding, torch.Tensor]:
    """``module`` with the ``merged`` rows (a mask over its stored rows) replaced by one row, row 0; returns it and
    its rows' read counts.

    The merged row is the mean of the merged rows training never read, where there are any: the vector the model
    reads for an id it knows nothing of, on which its mean prediction is calibrated. Else (a compacted table's
    merged row is among them) their read-weighted mean. Not the read-weighted mean of all: a rarely read row is
    skewed toward the majority label (AdamW moves a row by about the LR a step whatever the gradient's size, so
    a row read a few times moves with its labels' signs, mostly negative at a 21 % click rate); their mean, read
    by every merged id, lowered a DeepFM's mean pCTR from 0.207 to 0.190 at a click rate of 0.210 (the never-read
    rows' mean: 0.209)."""
    weight = module.weight.detach()
    gone = torch.from_numpy(merged).to(weight.device)
    if isinstance(module, CompactEmbedding):
        gone[0] = True  # the old merged row joins the new one
    w = reads.to(weight.device, weight.dtype)[gone]
    rows = weight[gone]
    unread = w == 0
    if bool(unread.any()):  # what the model reads for an id training never showed it, the rows it is calibrated on
        mean = rows[unread].mean(0)
    else:
        mean = (w[:, None] * rows).sum(0) / w.sum()
    keep = (~gone).nonzero().flatten()
    mapping = torch.zeros(module.num_embeddings, dtype=torch.long, device=weight.device)
    mapping[keep] = torch.arange(1, len(keep) + 1, device=weight.device)
    index = mapping[module.index.long()] if isinstance(module, CompactEmbedding) else mapping
    projection = module.projection.detach() if isinstance(module, CompactEmbedding) and module.projected else None
    table = CompactEmbedding(torch.cat([mean[None], weight[keep]]), index, projection)
    return table, torch.cat([reads[gone.cpu()].sum()[None], reads[keep.cpu()]])


@dataclass
class Spectrum:
    """A table's weighted SVD: ``basis`` (d x d, columns by falling weight) and each direction's ``share`` of
    the weighted energy."""

    basis: torch.Tensor
    share: np.ndarray


@torch.no_grad()
def spectrum(module: nn.Embedding, reads: torch.Tensor) -> Spectrum:
    """The eigen-directions of ``T.T @ diag(reads + 1) @ T`` of the table ``T`` as the model reads it (rows x d)."""
    rows = module.weight.detach().double()
    if isinstance(module, CompactEmbedding) and module.projected:
        rows = rows @ module.projection.detach().double().T
    gram = rows.T @ ((reads.to(rows.device, torch.float64) + 1)[:, None] * rows)
    values, vectors = torch.linalg.eigh(gram)  # ascending
    values, vectors = values.flip(0).clamp(min=0), vectors.flip(1)
    return Spectrum(vectors, (values / values.sum().clamp(min=1e-30)).cpu().numpy())


def allocate_ranks(spectra: dict[str, Spectrum], ranks: dict[str, int], columns: int) -> dict[str, int]:
    """Ranks at most ``columns`` in all, dropping the directions of least energy share across tables (each table
    keeps one at least and never gains one)."""
    ranks = dict(ranks)
    drop = [(s.share[j], name, j) for name, s in spectra.items() for j in range(1, ranks[name])]
    for _, name, j in sorted(drop):
        if sum(ranks.values()) <= columns:
            break
        ranks[name] = min(ranks[name], j)
    return ranks


@torch.no_grad()
def factor(module: nn.Embedding, spec: Spectrum, r: int) -> CompactEmbedding:
    """``module`` stored at rank ``r``: rows ``T @ B``, projection ``B`` (d x r), ``B`` the top ``r`` directions."""
    table = module if isinstance(module, CompactEmbedding) else CompactEmbedding(
        module.weight.detach(), torch.arange(module.num_embeddings))
    rows = table.weight.detach().double()
    if table.projected:
        rows = rows @ table.projection.detach().double().T
    basis = spec.basis[:, :r].to(rows.device)
    dtype = module.weight.dtype
    return CompactEmbedding((rows @ basis).to(dtype), table.index, basis.to(dtype))


class TableStrategy(Strategy):
    """`granularity: tables`: each round merges the least-read rows of the candidate tables (``rows``: share of
    their rows) and cuts their stored widths by weighted SVD (``dims``: share of their columns), toward the
    round's share of the target. Reads are counted over the training split (``importance_batches`` x
    ``importance_batch_size`` samples of it when set)."""

    def entering(self) -> dict[str, int]:
        cfg = self.config
        self.output = self._output() if cfg.target.outputs is not None else None
        touches_tables = cfg.target.rows is not None or cfg.target.dims is not None
        self.names = candidate_tables(self.model, cfg.min_rows, self._ignored()) if touches_tables else []
        if touches_tables and not self.names:
            found = [f"{n} ({source_rows(m)} rows)" for n, m in self.model.named_modules() if isinstance(m, nn.Embedding)]
            bags = bag_note(self.model)
            raise ConfigError(self.loc("min_rows"), f"the model has no embedding table of at least {cfg.min_rows} rows"
                              + (" outside `ignore`" if cfg.ignore else "") + (f"; its tables: {', '.join(found[:6])}"
                                                                              if found else "; it has no nn.Embedding")
                              + (f"; {bags}" if bags else ""),
                              value=cfg.min_rows, hint="lower min_rows, or prune this model by channels")
        self.before = self.measure()
        self.start = {n: (m.num_embeddings, rank(m), table_bytes(m)) for n, m in self._tables().items()}
        self.unread: dict[str, int] = {}
        return self.before

    def _output(self) -> str:
        """The output projection whose rows `outputs` merges (``catalogue.py``); a ConfigError when there is none."""
        name = output_projection(self.model, self.example, self.config.min_rows)
        if name is None or any(name == i or name.startswith(i + ".") for i in self._ignored()):
            raise ConfigError(self.loc("target", "outputs"), "outputs merges rows of the Linear whose output is the "
                              f"model's output, one row per catalogue item or class, of at least {self.config.min_rows} "
                              "rows and not tied to a table; this model has none" + (" outside `ignore`" if name else ""),
                              value=self.config.target.outputs, hint="drop outputs, or lower min_rows")
        return name

    def _ignored(self) -> tuple[str, ...]:
        names = [n for n, _ in self.model.named_modules() if n]
        out: list[str] = []
        for pattern in self.config.ignore or []:
            hits = [n for n in names if n == pattern or re.fullmatch(pattern, n)]
            if not hits:
                raise ConfigError(self.loc("ignore"), f"{pattern!r} matches no module of the model", value=pattern,
                                  hint="use table names from `pruneflow inspect` (first column) or a regex")
            out += hits
        return tuple(out)

    def _tables(self) -> dict[str, nn.Embedding]:
        return tables_of(self.model, self.names)

    def rounds(self) -> int:
        return 1 if self.config.rounds == "auto" else self.config.rounds

    def goal(self, index: int, rounds: int) -> dict[str, float]:
        target, out = self.config.target, {}
        if target.rows is not None:
            out["rows"] = self.before["rows"] * (1 - target.rows * index / rounds)
        if target.dims is not None:
            out["columns"] = self.before["columns"] * (1 - target.dims * index / rounds)
        if target.outputs is not None:
            out["outputs"] = self.before["outputs"] * (1 - target.outputs * index / rounds)
        return out

    def score(self, batches: Callable[[], Batches]) -> dict[str, torch.Tensor]:
        cfg, device = self.config, next(self.model.parameters()).device
        if self.data is not None and cfg.importance_batches is None:
            x = self.data.train.x
        else:
            from ..inputs import cat

            x = cat([b for b, _ in batches()])
        counts = count_reads(self.model, self.names, x, str(device)) if self.names else {}
        for name, reads in counts.items():
            self.unread.setdefault(name, int((reads == 0).sum()))
        if self.output is not None:  # what the training split labels each output row
            labels = self.data.train.y if self.data is not None else torch.cat([y for _, y in batches()])
            counts[OUTPUTS] = label_counts(labels, output_count(self.model.get_submodule(self.output)))
            self.unread.setdefault(OUTPUTS, int((counts[OUTPUTS] == 0).sum()))
        return counts

    def plan(self, scores: dict[str, torch.Tensor], goal: dict[str, float]) -> Plan:
        def apply() -> dict[str, float]:
            counts = {n: c for n, c in scores.items() if n != OUTPUTS}  # the tables' reads
            removed, tables = {"rows": 0.0, "columns": 0.0}, self._tables()
            if "rows" in goal or any(int((c == 0).sum()) for c in counts.values()):
                plain = sum(1 for m in tables.values() if not isinstance(m, CompactEmbedding))
                excess = max(0, math.ceil(sum(m.num_embeddings for m in tables.values()) + plain - goal.get("rows", math.inf)))
                for name, merged in rows_to_remove(tables, counts, excess).items():
                    if merged.any():
                        table, counts[name] = merge_rows(tables[name], merged, counts[name])
                        removed["rows"] += tables[name].num_embeddings - table.num_embeddings
                        _set(self.model, name, table)
            if "columns" in goal:
                removed["columns"] = self._cut_columns(counts, goal["columns"])
            if "outputs" in goal and self.output is not None:
                removed["outputs"] = self._merge_outputs(scores[OUTPUTS], goal["outputs"])
            return removed

        return Plan(apply)

    def _merge_outputs(self, counts: torch.Tensor, rows: float) -> float:
        """Merge the output projection's rows down to ``rows`` (the never-labelled always); returns the rows gone."""
        assert self.output is not None
        module = self.model.get_submodule(self.output)
        merge = max(0, math.ceil(len(counts) + 1 - rows))  # the merged row is one of the rows computed
        mask = rows_to_merge(module, counts, merge)
        if not bool(mask.any()):
            return 0.0
        compact = merge_output_rows(module, mask)
        _set(self.model, self.output, compact)
        return float(output_rows(module) - compact.rows)

    def _cut_columns(self, counts: dict[str, torch.Tensor], columns: float) -> float:
        tables = self._tables()
        spectra = {n: spectrum(m, counts[n]) for n, m in tables.items()}
        ranks = {n: rank(m) for n, m in tables.items()}
        new = allocate_ranks(spectra, ranks, int(math.floor(columns)))
        for name, module in tables.items():
            if new[name] < ranks[name]:
                _set(self.model, name, factor(module, spectra[name], new[name]))
        return float(sum(ranks.values()) - sum(new.values()))

    def measure(self) -> dict[str, int]:
        macs, params = count_macs_params(self.model, self.example)
        tables = self._tables()
        outputs = {"outputs": output_rows(self.model.get_submodule(self.output))} if self.output is not None else {}
        return {"macs": macs, "params": params, "rows": sum(m.num_embeddings for m in tables.values()),
                "columns": sum(rank(m) for m in tables.values()), "table_bytes": sum(table_bytes(m) for m in tables.values()),
                **outputs}

    def row(self, record: Round) -> dict:
        after, before = record.figures, self.before
        out: dict = {"round": record.index}
        if self.names:
            out.update({"rows": after["rows"], "rows_kept": round(after["rows"] / before["rows"], 4), "columns": after["columns"],
                        "table_mib": round(after["table_bytes"] / 2**20, 2),
                        "table_bytes_kept": round(after["table_bytes"] / before["table_bytes"], 4)})
        if self.output is not None:
            out.update({"output_rows": after["outputs"], "macs": after["macs"]})
        return {**out, record.metric: record.value, "seconds": record.seconds}

    def describe(self, record: Round) -> str:
        f, parts = record.figures, []
        if self.names:
            parts.append(f"{f['rows']:,} table rows ({f['rows'] / self.before['rows']:.1%}), {f['columns']} columns stored, "
                         f"tables {f['table_bytes'] / self.before['table_bytes']:.1%} of their FP32 bytes")
        if self.output is not None:
            parts.append(f"{f['outputs']:,} of {self.before['outputs']:,} output rows computed "
                         f"({f['macs'] / self.before['macs']:.1%} of the MACs)")
        return f"{', '.join(parts)}, {record.metric} {record.value:.4f}"

    def summary(self, after: dict[str, int]) -> dict[str, float | int]:
        b = self.before
        out: dict[str, float | int] = {}
        if self.names:
            out.update({"rows_before": b["rows"], "rows": after["rows"], "columns_before": b["columns"], "columns": after["columns"],
                        "table_bytes_before": b["table_bytes"], "table_bytes": after["table_bytes"],
                        "table_reduction": b["table_bytes"] / max(after["table_bytes"], 1),
                        "rows_never_read": sum(v for k, v in self.unread.items() if k != OUTPUTS)})
        if self.output is not None:
            out.update({"output_rows_before": b["outputs"], "output_rows": after["outputs"],
                        "outputs_never_labelled": self.unread.get(OUTPUTS, 0)})
        return out

    def tables(self, records: list[Round]) -> dict[str, list[dict]]:
        out = []
        for name, module in self._tables().items():
            rows, width, size = self.start[name]
            out.append({"table": name, "ids": source_rows(module), "never_read": self.unread.get(name, 0),
                        "rows_before": rows, "rows": module.num_embeddings, "columns_before": width,
                        "columns": rank(module), "width_read": out_width(module),
                        "mib_before": round(size / 2**20, 3), "mib": round(table_bytes(module) / 2**20, 3)})
        note = bag_note(self.model)
        found: dict[str, list[dict]] = {"embedding_tables": out} if self.names else {}
        if self.output is not None:
            found["output_rows"] = [{"projection": self.output, "outputs": self.before["outputs"],
                                     "never_labelled": self.unread.get(OUTPUTS, 0), "rows_before": self.before["outputs"],
                                     "rows": output_rows(self.model.get_submodule(self.output))}]
        return {**found, **({"notes": [{"note": note}]} if note else {})}
