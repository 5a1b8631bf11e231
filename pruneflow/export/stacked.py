"""A ranker's per-field int8 table reads, stacked into one read of one table.

A DLRM or DeepFM with one table per categorical field reads field ``f`` as ``table_f[ids[:, f]]`` and stacks the
rows for its interaction: torch exports that as, per field, ``Gather(ids, f, axis=1)``, the row read,
``Unsqueeze(axis=1)``, then one ``Concat(axis=1)``. Stored int8 (``embedding.gather_rows``), a row read is three ops
(``Gather`` of the int8 rows, ``Gather`` of their scales, ``DequantizeLinear``) where the float one was a single
``Gather``: with five ops a field against three, the INT8 DLRM of ``recipes/dlrm-bags.yaml`` ran 0.91x of its FP32 ONNX
at batch 64 in onnxruntime, on op count rather than arithmetic (about 0.5 us an op).

``stack_field_reads`` rewrites each run of such reads that sit side by side in one Concat and read columns of the same
ids tensor into one read of the run's tables stacked row-wise, each field's ids shifted by its table's first row::

    Slice(ids, c0, c0 + n) -> Add(row offsets [n]) -> Gather(int8 rows [sum V, D]) -> Cast
                                                   -> Gather(scales [sum V, 1])   -> Mul -> [B, n, D] into the Concat

six ops for the whole run (a Gather of the listed columns where they are not consecutive) instead of 5n; into a flat
Concat of [B, D] rows (an MMoE's input) a Reshape to [B, n * D] follows. Summed bags (``export/bags.py``'s sum of a
padded bag, its padding row read through a scale of 0) stack the same way, their ids ``[B, n, L]`` transposed to
``[L, B, n]`` so the sum over each bag's ids is over the outer axis (L blocks added; onnxruntime's sum over a middle
axis took 19 us against 11 us for the DLRM's two bags at batch 64); a lone bag is rewritten so too. Exact: each value
is still ``float(q) * scale`` of its own row, summed in the same order. The tables' bytes are unchanged (each stored
once, in the stacked table) plus one int64 offset a field.

The stacked graph no longer fails on an id past its own field's table: such an id reads a row of the next field's table
where the per-field graph stopped with a Gather index error (the last field's table still bounds it). The encoders this
project writes never produce one (an unknown value maps to its field's own out-of-vocabulary row, inside the table, and
the deployment record's ``preprocessing`` lists each field's vocabulary); a service that builds ids by other means must
keep each field's ids inside its table, and the artifact's notes say so.

No library we depend on does this rewrite (onnxruntime's optimizer fuses neither the reads nor their Concat; torchrec's
``KeyedJaggedTensor`` stacking does not export), so it is written here.

    stacked = stack_field_reads(model_proto)     # in place; one entry per run rewritten: fields, tables, ops saved
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class _FieldRead:
    """One field's int8 row read, ``kind`` ``one`` (one id a sample: ``DequantizeLinear(Gather(q, ids[:, c]),
    Gather(scale, ids[:, c]))``) or ``bag`` (a fixed-length bag summed: ``ReduceSum(Cast(Gather(q, bags[:, c])) *
    Unsqueeze(Gather(scale, bags[:, c])), axis=1)``), then ``Unsqueeze(axis=1)`` into a Concat; ``nodes`` are the ops
    the stacked read replaces, the column read last."""

    kind: str
    flat: bool        # read straight into a flat Concat of [B, D] rows (an MMoE's input), not stacked through an Unsqueeze
    ids: str
    column: int
    q: str
    scale: str
    out: str          # the Unsqueeze's output, the Concat's input
    nodes: list


def _graph_maps(graph) -> tuple[dict, dict, dict]:
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    return producer, consumers, {t.name: t for t in graph.initializer}


def _const(inits: dict, name: str) -> np.ndarray | None:
    from onnx import numpy_helper

    return numpy_helper.to_array(inits[name]) if name in inits else None


def _attr(node, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _op(producer: dict, name: str, op_type: str):
    node = producer.get(name)
    return node if node is not None and node.op_type == op_type else None


def _axes_are(node, inits: dict, axes: list[int]) -> bool:
    found = _const(inits, node.input[1]) if len(node.input) > 1 else None
    return found is not None and found.reshape(-1).tolist() == axes


def _one_id_read(value: str, producer: dict, inits: dict):
    """``(rows Gather, scales Gather, [ops])`` where ``value`` is a one-id int8 row read (``embedding.gather_rows``)."""
    dq = _op(producer, value, "DequantizeLinear")
    if dq is None or len(dq.input) != 2 or _attr(dq, "axis", 1) != 0:
        return None
    rows, scales = _op(producer, dq.input[0], "Gather"), _op(producer, dq.input[1], "Gather")
    return None if rows is None or scales is None else (rows, scales, [dq])


def _bag_sum_read(value: str, producer: dict, inits: dict):
    """``(rows Gather, scales Gather, [ops])`` where ``value`` is a summed bag of int8 rows (``gather_rows`` on a bag of
    ids, ``export/bags.py``'s sum with the padding row's scale 0, its mask multiply dropped)."""
    total = _op(producer, value, "ReduceSum")
    if total is None or _attr(total, "keepdims", 1) != 0 or not _axes_are(total, inits, [1]):
        return None
    mul = _op(producer, total.input[0], "Mul")
    if mul is None:
        return None
    cast, unsqueeze = _op(producer, mul.input[0], "Cast"), _op(producer, mul.input[1], "Unsqueeze")
    if cast is None or unsqueeze is None or not _axes_are(unsqueeze, inits, [-1]):
        return None
    rows, scales = _op(producer, cast.input[0], "Gather"), _op(producer, unsqueeze.input[0], "Gather")
    return None if rows is None or scales is None else (rows, scales, [total, mul, cast, unsqueeze])


def _field_read(concat_input: str, producer: dict, consumers: dict, inits: dict) -> _FieldRead | None:
    """The field read that produces ``concat_input`` (through ``Unsqueeze(axis=1)``: a stack of fields; or directly: a
    flat Concat of [B, D] rows), or None where it is anything else."""
    unsqueeze = _op(producer, concat_input, "Unsqueeze")
    stacked = unsqueeze is not None and _axes_are(unsqueeze, inits, [1])
    value = unsqueeze.input[0] if stacked and unsqueeze is not None else concat_input
    for kind, match in (("one", _one_id_read), ("bag", _bag_sum_read)):
        found = match(value, producer, inits)
        if found is not None:
            break
    else:
        return None
    rows, scales, ops = found
    column_read = _op(producer, rows.input[1], "Gather")
    if (rows.input[1] != scales.input[1] or _attr(rows, "axis", 0) != 0 or _attr(scales, "axis", 0) != 0
            or column_read is None or _attr(column_read, "axis", 0) != 1):
        return None
    column = _const(inits, column_read.input[1])
    q, scale = _const(inits, rows.input[0]), _const(inits, scales.input[0])
    if (column is None or column.ndim != 0 or q is None or scale is None or q.dtype != np.int8 or q.ndim != 2
            or scale.shape != (q.shape[0],)):
        return None
    private = ([unsqueeze] if stacked else []) + [*ops, rows, scales]  # read by this chain only (not so the column read)
    if any(len(consumers.get(n.output[0], [])) != 1 for n in private):
        return None
    return _FieldRead(kind, not stacked, column_read.input[0], int(column), rows.input[0], scales.input[0], concat_input,
                      private + [column_read])


def _runs(concat, producer: dict, consumers: dict, inits: dict) -> list[list[_FieldRead]]:
    """Maximal runs of neighbouring Concat inputs that are field reads of one ids tensor, tables of one width: two or
    more one-id reads, one or more bags."""
    runs: list[list[_FieldRead]] = []
    current: list[_FieldRead] = []
    for name in list(concat.input) + [""]:
        read = _field_read(name, producer, consumers, inits) if name else None
        fits = (read is not None and current and read.ids == current[0].ids and read.kind == current[0].kind
                and read.flat == current[0].flat                and inits[read.q].dims[1] == inits[current[0].q].dims[1])
        if not fits:
            if len(current) > 1 or (current and current[0].kind == "bag"):  # a lone bag gains the outer-axis sum
                runs.append(current)
            current = []
        if read is not None:
            current.append(read)
    return runs


def stack_field_reads(model) -> list[dict]:
    """Rewrite every run of per-field int8 table reads into one stacked read (the module docstring); ``model`` is an
    onnx.ModelProto changed in place. Returns one dict per run: ``fields`` (ids columns), ``tables`` (their
    initializers, now stacked), ``ops_saved``."""
    graph = model.graph
    done: list[dict] = []
    for concat in [n for n in graph.node if n.op_type == "Concat" and _attr(n, "axis", 0) == 1]:
        producer, consumers, inits = _graph_maps(graph)
        for k, run in enumerate(_runs(concat, producer, consumers, inits)):
            done.append(_stack(graph, concat, run, inits, f"{concat.name or concat.output[0]}_stacked{k}"))
    if done:
        _drop_dead(graph)
    return done


def _stack(graph, concat, run: list[_FieldRead], inits: dict, tag: str) -> dict:
    """Replace ``run``'s reads by one stacked read whose output takes their place in ``concat``."""
    from onnx import TensorProto, helper, numpy_helper

    qs = [numpy_helper.to_array(inits[r.q]) for r in run]
    scales = [numpy_helper.to_array(inits[r.scale]) for r in run]
    offsets = np.cumsum([0] + [q.shape[0] for q in qs[:-1]]).astype(np.int64)
    if run[0].kind == "bag":
        offsets = offsets.reshape(-1, 1)  # [n, 1] against the bags' [B, n, L] (before they are transposed)
    columns = [r.column for r in run]
    consts = {f"{tag}_int8": np.concatenate(qs), f"{tag}_scale": np.concatenate(scales).reshape(-1, 1).astype(np.float32),
              f"{tag}_offsets": offsets}
    nodes = [_columns(run[0].ids, columns, tag, consts),
             helper.make_node("Add", [f"{tag}_ids", f"{tag}_offsets"], [f"{tag}_rows_at"], name=f"{tag}_Offsets")]
    if run[0].kind == "bag":  # [B, n, L] -> [L, B, n]: the sum over a bag's ids is then over the outer axis (below)
        nodes[-1].output[0] = f"{tag}_rows_at_bnl"
        nodes.append(helper.make_node("Transpose", [f"{tag}_rows_at_bnl"], [f"{tag}_rows_at"], name=f"{tag}_IdsOuter",
                                      perm=[2, 0, 1]))
    nodes += [
        helper.make_node("Gather", [f"{tag}_int8", f"{tag}_rows_at"], [f"{tag}_q"], name=f"{tag}_GatherRows", axis=0),
        helper.make_node("Cast", [f"{tag}_q"], [f"{tag}_float"], name=f"{tag}_Cast", to=TensorProto.FLOAT),
        helper.make_node("Gather", [f"{tag}_scale", f"{tag}_rows_at"], [f"{tag}_row_scale"], name=f"{tag}_GatherScales", axis=0),
        helper.make_node("Mul", [f"{tag}_float", f"{tag}_row_scale"], [f"{tag}_values"], name=f"{tag}_Mul"),
    ]
    if run[0].kind == "bag":  # [L, B, n, D] summed over each bag's ids: L blocks added, where a middle axis took
        # onnxruntime 19 us against 11 us for [64, 2, 4, 16] (the DLRM: 1.06x of FP32 at batch 64 against 0.95x)
        consts[f"{tag}_bag_axis"] = np.array([0], np.int64)
        nodes.append(helper.make_node("ReduceSum", [f"{tag}_values", f"{tag}_bag_axis"], [f"{tag}_summed"], name=f"{tag}_Sum",
                                      keepdims=0))
    if run[0].flat:  # [B, n, D] -> [B, n * D], the fields' rows side by side as the flat Concat had them
        consts[f"{tag}_flat"] = np.array([0, -1], np.int64)
        nodes.append(helper.make_node("Reshape", [nodes[-1].output[0], f"{tag}_flat"], [f"{tag}_flattened"], name=f"{tag}_Flatten"))
    out = nodes[-1].output[0]
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    inputs = list(concat.input)
    first = inputs.index(run[0].out)
    del concat.input[:]
    concat.input.extend(inputs[:first] + [out] + inputs[first + len(run):])
    index = list(graph.node).index(concat)
    for offset, node in enumerate(nodes):
        graph.node.insert(index + offset, node)
    for node in [n for r in run for n in r.nodes[:-1]]:  # the column reads go with _drop_dead, if nothing else reads them
        graph.node.remove(node)
    return {"kind": run[0].kind, "fields": columns, "tables": [r.q for r in run],
            "ops_saved": sum(len(r.nodes) for r in run) - len(nodes)}


def _columns(ids: str, columns: list[int], tag: str, consts: dict):
    """The op reading the run's columns of ``ids`` (``<tag>_ids``): a Slice where they are consecutive, else a Gather."""
    from onnx import helper

    if columns == list(range(columns[0], columns[0] + len(columns))):
        consts.update({f"{tag}_start": np.array([columns[0]], np.int64), f"{tag}_end": np.array([columns[-1] + 1], np.int64),
                       f"{tag}_axis": np.array([1], np.int64)})
        return helper.make_node("Slice", [ids, f"{tag}_start", f"{tag}_end", f"{tag}_axis"], [f"{tag}_ids"], name=f"{tag}_Slice")
    consts[f"{tag}_columns"] = np.array(columns, np.int64)
    return helper.make_node("Gather", [ids, f"{tag}_columns"], [f"{tag}_ids"], name=f"{tag}_Columns", axis=1)


def _drop_dead(graph) -> None:
    """Remove ops whose outputs nothing reads (the per-field column reads), then initializers nothing reads."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    read = {i for n in graph.node for i in n.input} | outputs
    for t in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(t)


def notes(stacked: list[dict]) -> list[str]:
    return [f"{len(s['fields'])} {'one-id' if s['kind'] == 'one' else 'summed bag'} table reads (input columns {s['fields']}) "
            f"stacked into one read of one int8 table with per-field row offsets: {s['ops_saved']} fewer ops (an id past its "
            "own field's table now reads another field's row instead of failing: keep ids inside their tables)" for s in stacked]
