"""Tied tables stored once: the item (or word) table that a model both looks rows up in and scores against.

A sequential recommender or a language model ties its output projection to its input table
(``self.output.weight = self.items.weight``, or ``h @ self.items.weight.T`` in forward): one [V, H] parameter
serves the lookup (``Gather``) and the scores (``MatMul``). The exporters lose the tie:

- float: constant folding writes the transposed weight of the MatMul as an initializer of its own, so the
  FP32 ONNX of a 20000 x 64 SASRec held the table twice (10.01 MiB against 5.20 MiB for the OpenVINO IR,
  which transposes it back and finds the bytes equal);
- INT8: the weight quantizer of the output becomes an int8 initializer (``qdq.fold_weight_quantizers``)
  while the Gather keeps the float table, which the CPU form then stores int8 a second time
  (``embedding.quantize_embeddings``: 2.70 MiB, two int8 copies) and the TensorRT form leaves float (6.29 MiB).

``share_tied_tables`` finds the tie again from the values and makes both readers read one initializer:

- float (every ONNX, after constant folding): an initializer equal to a Gather table, or to its transpose, is
  dropped; its readers read the table (a Gemm by flipping ``transA``/``transB``, anything else through one
  ``Transpose`` of the table, which onnxruntime and OpenVINO fold when they load the model, so the speed
  is the folded graph's);
- INT8 (``form`` given, after the Q/DQ passes and before ``quantize_embeddings``): a per-row int8 weight
  ``DequantizeLinear(q [V, H], scale [V], axis=0)`` whose values are the Gather table rounded onto that grid is
  the table in int8 with one scale per row, i.e. exactly the per-row layout the lookup wants (the row scale of
  the table is the per-output-channel scale of the projection). The lookup then reads the weight's ``q`` and
  ``scale``: the CPU form gathers int8 rows and their scales (``embedding.gather_rows``: only the rows read are
  converted), the TensorRT form reads the DequantizeLinear's output (TensorRT takes int8 constants through
  DequantizeLinear only), and the float table is dropped.

The u8s8 encoding of the CPU form is the one case where the two readers want different grids: ``fit_u8s8_pairs``
re-grids the output's rows coarser (so x86 kernels without VNNI cannot saturate), while the quantized torch model
looks rows up on the 8-bit grid. Storing both would keep the second copy; here the lookup reads the re-gridded rows
too (the change, at most half a coarser step, is in the artifact's notes). Measured on the 20000 x 64 SASRec (512
sequences, against the quantized torch model): top-10 overlap 0.9836 with two copies, 0.9807 with one, in onnxruntime
and OpenVINO alike; the file 2.83 -> 1.47 MB, the IR 2.78 -> 1.42 MB. The u8s8_vnni and s8s8 encodings and the
TensorRT form share exactly (the same outputs as with two copies). onnxruntime, checking the TensorRT form, now
dequantizes the whole table at each call for the lookup (20000 x 64, one thread: 0.59 -> 0.87 ms at batch 1, 4.03 ->
4.18 ms at batch 64; that form's onnxruntime latency says nothing of TensorRT's). A tie written in forward (``h @
items.weight.T``: NNCF quantizes the activation, not the transposed table) first gets the weight quantizer a Linear
has (``quantize_float_ties``), then is shared as above; a table off its int8 grid or read by a float op stays float,
shared in float.

    report = share_tied_tables(model_proto)            # float ONNX, in place
    report = share_tied_tables(model_proto, "cpu")     # INT8 ONNX of a form, in place
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .qdq.graph import convention

#: How far, in steps of the weight's grid, the float table may sit from the dequantized weight and still be
#: its quantization: the quantization stage leaves the table exactly on the grid (``exact``, a thousandth of a
#: step for float rounding), the x86 u8s8 fit (``qdq.fit_u8s8_pairs``) re-grids a row coarser, where the table
#: then lies within half a (coarser) step. An unrelated weight of the same shape is nowhere near either.
EXACT_STEPS = 1e-3
ROUNDED_STEPS = 0.5 + 1e-3


@dataclass
class TiedReport:
    #: per table shared: name, shape, reader (how the output reads it), bytes_saved, grid ("float", "int8", or
    #: "int8 re-gridded": the lookup reads the output's coarser rows) and max_abs_change of a looked-up value
    tables: list[dict] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(t["bytes_saved"] for t in self.tables)

    def notes(self) -> list[str]:
        out = []
        for t in self.tables:
            note = (f"tied table {t['name']} {t['shape'][0]}x{t['shape'][1]} stored once ({t['grid']}), read by the lookup and "
                    f"by the output ({t['reader']}): {t['bytes_saved'] / 1e6:.2f} MB saved")
            if t["max_abs_change"]:
                note += (f"; the lookup reads the output's rows, re-gridded for x86 u8s8 kernels (max abs change "
                         f"{t['max_abs_change']:.3g} against the quantized table)")
            out.append(note)
        return out


class _View:
    """Initializers, producers and readers of an onnx.GraphProto, refreshed after each rewrite."""

    def __init__(self, graph):
        from onnx import numpy_helper

        self.g, self.nh = graph, numpy_helper
        self.refresh()

    def refresh(self) -> None:
        self.inits = {t.name: t for t in self.g.initializer}
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.readers: dict[str, list[tuple[Any, int]]] = {}
        for node in self.g.node:
            for k, name in enumerate(node.input):
                self.readers.setdefault(name, []).append((node, k))
        self.outputs = {o.name for o in self.g.output}

    def array(self, name: str) -> np.ndarray | None:
        return self.nh.to_array(self.inits[name]) if name in self.inits else None

    def tables(self) -> list[str]:
        """Initializers of rank 2 read as the data of an axis-0 Gather (what ``component_bytes`` counts as tables)."""
        found = []
        for name, init in self.inits.items():
            gathers = [n for n, k in self.readers.get(name, []) if n.op_type == "Gather" and k == 0 and _attr(n, "axis", 0) == 0]
            if gathers and len(init.dims) == 2 and name not in self.outputs:
                found.append(name)
        return found

    def fresh_name(self, base: str) -> str:
        name, i = base, 0
        while name in self.inits or name in self.producer or name in self.readers:
            i += 1
            name = f"{base}_{i}"
        return name

    def insert_before_first_reader(self, node, of: str) -> None:
        """Insert ``node`` just before the first node reading ``of`` (its inputs are initializers: order holds)."""
        index = next(i for i, n in enumerate(self.g.node) if of in n.input)
        self.g.node.insert(index, node)

    def drop_unread(self, names) -> None:
        for name in names:
            if name in self.inits and not self.readers.get(name) and name not in self.outputs:
                self.g.initializer.remove(self.inits[name])
        self.refresh()


def _attr(node, name: str, default):
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _set_attr(node, name: str, value: int) -> None:
    from onnx import helper

    for a in list(node.attribute):
        if a.name == name:
            node.attribute.remove(a)
    node.attribute.append(helper.make_attribute(name, value))


def share_tied_tables(model, form: str | None = None) -> TiedReport:
    """Make every reader of a copy of a Gather table read the table itself, in the ONNX ``model`` (a ModelProto,
    changed in place): float copies (equal, or equal transposed) always; with ``form`` (``cpu`` or ``tensorrt``: an
    INT8 ONNX after ``qdq.convert``), also the int8 weight of a tied output projection, whose ``q`` and per-row
    ``scale`` then serve the lookup. Returns what was shared; a model without a tie is left as it was."""
    view = _View(model.graph)
    report = TiedReport()
    for table in view.tables():
        _share_float_copies(view, table, report)
    if form is not None:
        for table in view.tables():
            _share_quantized(view, table, form, report)
    return report


def _share_float_copies(view: _View, table: str, report: TiedReport) -> None:
    """Drop each initializer equal to ``table`` or to its transpose; its readers read ``table``."""
    value = view.array(table)
    assert value is not None
    for name, init in list(view.inits.items()):
        if name == table or init.data_type != view.inits[table].data_type or name in view.outputs:
            continue
        if sorted(init.dims) != sorted(value.shape):
            continue
        copy = view.array(name)
        assert copy is not None
        if copy.shape == value.shape and np.array_equal(copy, value):
            readers = _rewire(view, name, table, transposed=False)
        elif copy.shape == value.shape[::-1] and np.array_equal(copy, value.T):
            readers = _rewire(view, name, table, transposed=True)
        else:
            continue
        view.drop_unread([name])
        report.tables.append({"name": table, "shape": list(value.shape), "reader": readers, "bytes_saved": copy.nbytes,
                              "grid": "float", "max_abs_change": 0.0})


def _rewire(view: _View, copy: str, table: str, *, transposed: bool) -> str:
    """Point the readers of ``copy`` at ``table``: as they are when equal; transposed, a Gemm flips ``transA``/``transB``
    and anything else reads one ``Transpose(table)``. Returns how the readers read it, for the report.

    Why a Transpose rather than rewriting a MatMul as Gemm(transB=1): it keeps the op and its rank (a MatMul of a
    3-D state needs no Gemm's 2-D input), and both runtimes fold a Transpose of a constant when they load the
    model, so they run the same kernel as before (timed interleaved: tests/test_tied_tables.py's docstring)."""
    from onnx import helper

    how = set()
    transpose_out = view.fresh_name(f"{table}_transposed")
    for node, k in list(view.readers.get(copy, [])):
        if not transposed:
            node.input[k] = table
            how.add(f"{node.op_type}")
        elif node.op_type == "Gemm" and k in (0, 1):
            flag = "transA" if k == 0 else "transB"
            _set_attr(node, flag, 1 - int(_attr(node, flag, 0)))
            node.input[k] = table
            how.add(f"Gemm {flag}")
        else:
            node.input[k] = transpose_out
            how.add(f"{node.op_type} via Transpose")
    if any(transpose_out in n.input for n in view.g.node):  # one Transpose, before the first of its readers
        view.insert_before_first_reader(helper.make_node("Transpose", [table], [transpose_out], name=f"{table}_Transpose",
                                                         perm=[1, 0]), transpose_out)
    view.refresh()
    return ", ".join(sorted(how))


def _int8_tie(view: _View, table: np.ndarray) -> tuple[Any, float] | None:
    """The DequantizeLinear of a per-row int8 weight [V, H] (scale [V] on axis 0, zero point 0) whose grid ``table`` is
    on (``EXACT_STEPS``) or rounds onto (``ROUNDED_STEPS``: re-gridded by the u8s8 fit), with the largest change of a
    table value reading it instead; None when there is none."""
    for node in view.g.node:
        if node.op_type != "DequantizeLinear" or _attr(node, "axis", 1) != 0:
            continue
        q, scale = view.array(node.input[0]), view.array(node.input[1])
        zp = view.array(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if q is None or scale is None or q.dtype != np.int8 or q.shape != table.shape or scale.shape != (table.shape[0],):
            continue
        if zp is not None and np.any(zp):
            continue
        values = q.astype(np.float32) * scale[:, None]
        steps = np.abs(values - table) / np.maximum(scale[:, None], np.finfo(np.float32).tiny)
        if steps.max() <= ROUNDED_STEPS:
            return node, 0.0 if steps.max() <= EXACT_STEPS else float(np.abs(values - table).max())
    return None


def _share_quantized(view: _View, table: str, form: str, report: TiedReport) -> None:
    """The lookup of float ``table`` reads the int8 weight of the output it is tied to (``_int8_tie``)."""
    from .embedding import gather_rows

    value = view.array(table)
    assert value is not None
    if any(node.op_type != "Gather" or k != 0 for node, k in view.readers[table]):
        return  # also read in float (an output NNCF left float, sharing it since the float pass): it stays float
    found = _int8_tie(view, value)
    if found is None:
        return
    dq, change = found
    if convention(form).dequantized_constants:
        # TensorRT reads int8 constants through DequantizeLinear only: the lookup gathers from its output, the one
        # DequantizeLinear the projection reads too (moved before the first Gather, its inputs being initializers)
        moved = type(dq)()
        moved.CopyFrom(dq)
        view.g.node.remove(dq)
        for node, k in view.readers[table]:
            node.input[k] = moved.output[0]
        view.insert_before_first_reader(moved, moved.output[0])
        reader = "Gather of the DequantizeLinear the output reads"
    else:
        # the CPU form gathers int8 rows and their scales, then converts only them (embedding.py's ``gather_rows``:
        # a DequantizeLinear of the whole table before the Gather made a ranker 9.9x slower at batch 1)
        gather_rows(view.g, table, q=dq.input[0], scale=dq.input[1])
        reader = "Gather of int8 rows and row scales"
    view.refresh()
    view.drop_unread([table])
    # the second copy this leaves out: the float table (TensorRT form), or the int8 rows and scales quantize_embeddings
    # would have written for it (CPU form)
    saved = value.nbytes if convention(form).dequantized_constants else value.size + 4 * value.shape[0]
    report.tables.append({"name": table, "shape": list(value.shape), "reader": reader, "bytes_saved": saved,
                          "grid": "int8 re-gridded" if change else "int8", "max_abs_change": change})


def quantize_float_ties(model) -> list[str]:
    """Give a tie written in forward (``h @ items.weight.T``, ``F.linear(h, items.weight)``) the per-row int8 weight
    quantizer NNCF gives a Linear, in the raw Q/DQ ONNX ``model`` (a ModelProto, changed in place) before ``qdq.convert``;
    returns the tables so quantized.

    NNCF quantizes such a projection's activation but not the table (it is no module's weight), so the scores stayed a
    float MatMul and the table float for the lookup too: the INT8 file was as large as the FP32 one. Where the table is on
    its per-row int8 grid (``embedding.snap_embedding_tables``: what the quantization stage measured), a reader of its
    values in transposed layout (a folded copy ``W == table.T`` read as a MatMul's weight, a ``Transpose`` of the table,
    or a ``Gemm`` with ``transB``) whose other input is quantized now reads
    ``Transpose(DequantizeLinear(QuantizeLinear(table, row scales, axis=0)))`` (a Gemm without the Transpose): exactly
    the values torch multiplied, since the table lies on that grid. ``convert`` then folds the weight to int8 as any
    other (and, in the u8s8 encoding, re-grids its rows where x86 kernels without VNNI could saturate), and
    ``share_tied_tables(form)`` makes the lookup read that one int8 table."""
    from onnx import helper

    from .embedding import grid_bits, quantize_rows

    view, done = _View(model.graph), []
    for table in view.tables():
        value = view.array(table)
        if value is None or value.dtype != np.float32 or grid_bits(value) != 8:
            continue
        readers = _transposed_readers(view, table, value)
        if not readers:
            continue
        _, scale = quantize_rows(value)
        names = {k: view.fresh_name(f"{table}_tie_{k}") for k in ("scale", "zero_point", "q", "dq", "t")}
        model.graph.initializer.extend([view.nh.from_array(scale, names["scale"]),
                                        view.nh.from_array(np.zeros(len(scale), np.int8), names["zero_point"])])
        nodes = [helper.make_node("QuantizeLinear", [table, names["scale"], names["zero_point"]], [names["q"]],
                                  name=names["q"], axis=0),
                 helper.make_node("DequantizeLinear", [names["q"], names["scale"], names["zero_point"]], [names["dq"]],
                                  name=names["dq"], axis=0),
                 helper.make_node("Transpose", [names["dq"]], [names["t"]], name=names["t"], perm=[1, 0])]
        replaced = [node.input[k] for node, k, _ in readers]  # the copies and Transposes nothing reads after this
        for node, k, layout in readers:
            node.input[k] = names["dq"] if layout == "rows" else names["t"]
        for offset, node in enumerate(nodes):
            model.graph.node.insert(offset, node)
        _drop_dead_transposes(model.graph, table)
        view.refresh()
        view.drop_unread(replaced)
        done.append(table)
    return done


def _transposed_readers(view: _View, table: str, value: np.ndarray) -> list[tuple[Any, int, str]]:
    """``(node, input index, layout)`` of each quantized MatMul/Gemm reading ``table``'s values as its weight: ``copy`` (an
    initializer equal to ``table.T``), ``transpose`` (through ``Transpose(table)``) or ``rows`` (a Gemm with ``transB``
    reading the table itself); empty unless every reader of the table other than its Gathers is one of these."""
    def quantized_input(node) -> bool:
        source = view.producer.get(node.input[0])
        return source is not None and source.op_type == "DequantizeLinear"

    found: list[tuple[Any, int, str]] = []
    for name, init in view.inits.items():
        if list(init.dims) == [value.shape[1], value.shape[0]] and name != table:
            uses = view.readers.get(name, [])
            copy = view.array(name)
            if uses and copy is not None and copy.dtype == value.dtype and np.array_equal(copy, value.T):
                if not all(n.op_type == "MatMul" and k == 1 and quantized_input(n) for n, k in uses):
                    return []
                found += [(n, k, "copy") for n, k in uses]
    for node, k in view.readers.get(table, []):
        if node.op_type == "Gather" and k == 0:
            continue
        if node.op_type == "Gemm" and k == 1 and _attr(node, "transB", 0) == 1 and quantized_input(node):
            found.append((node, k, "rows"))
        elif node.op_type == "Transpose" and list(_attr(node, "perm", [1, 0])) == [1, 0]:
            uses = view.readers.get(node.output[0], [])
            if not uses or not all(n.op_type == "MatMul" and j == 1 and quantized_input(n) for n, j in uses):
                return []
            found += [(n, j, "transpose") for n, j in uses]
        else:
            return []
    return found


def _drop_dead_transposes(graph, table: str) -> None:
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for node in [n for n in graph.node if n.op_type == "Transpose" and n.input[0] == table and n.output[0] not in read]:
        graph.node.remove(node)
