"""INT8 embedding tables (word, position) in ONNX: weight-only, symmetric, one scale per row.

A text model's word embedding is read by a ``Gather`` (ids -> rows) and is often half its bytes (MiniLM-L6:
30522 x 384 floats, 46.9 MB of 90.9 MB). Quantization-aware training and the QDQ passes quantize the inputs
of MatMul/Gemm only, so without this the table stays float32 in every INT8 artifact. onnxruntime's weight-only
quantizer (``MatMulNBitsQuantizer``) rewrites a Gather as ``com.microsoft.GatherBlockQuantized``, a contrib
operator outside standard ONNX; NNCF's ``compress_weights`` works on OpenVINO models, not on the ONNX every
artifact here is made from. So the rewrite is done here with standard ONNX operators only. Two layouts:

``gather_rows`` (default): ``Gather(table_int8, ids) -> Cast -> Mul(Unsqueeze(Gather(scale, ids)))``: only
  the gathered rows are converted, in every runtime; with one id a sample (a ranker's field)
  ``DequantizeLinear(Gather(table_int8, ids), Gather(scale, ids), axis=0)``, three ops instead of five; a padded
  bag's padding row gets scale 0, which makes its mask multiply redundant (``_padding_masks``).
``dequantize_table``: ``DequantizeLinear(table_int8, scale[V], axis=0) -> Gather``: onnxruntime dequantizes
  the whole table at every run.

Measured on a 2-layer, 64-wide BERT with a 30522-word table (batch 32 x 48 tokens, 2 cores, AVX-512):
the ONNX shrinks from 8.29 MB to 2.56 MB (gather_rows) / 2.59 MB (dequantize_table); onnxruntime takes
26.4 ms / 35.6 ms against 27.1 ms for FP32; OpenVINO keeps the table as an i8 constant in both (10.8 /
10.7 ms). Both store V*H int8 values plus V float scales (``dequantize_table`` adds V zero points): about
3.9x smaller than the float table. A value's rounding error is at most half its row's scale (max|row|/254).

    report = quantize_embeddings(model_proto)          # in place; rows describe each table rewritten
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Layout = Literal["dequantize_table", "gather_rows"]

#: ``quantize_embeddings`` with ``on_grid=False`` (a bare ONNX, no quantization stage before it) takes a Gather
#: table of at least this many bytes (float32) ... 256 KiB takes a BERT's position table too (512 x 384 floats).
MIN_BYTES = 262_144
#: ... or at least this share of all initializer bytes (a small text model's table).
MIN_SHARE = 0.25
#: The quantization stages put on the int8 grid every table of at least this many bytes (``snap_embedding_tables``):
#: int8 rows and a float scale a row are smaller than float rows from 2 columns on, so every table that is
#: not tiny shrinks (a ranker's 8 fields of 3-43 rows x 17 columns included); the export then stores exactly
#: the tables it finds on that grid (``on_grid``).
MIN_SNAP_BYTES = 1024


@dataclass
class EmbeddingReport:
    tables: list[dict] = field(default_factory=list)  # name, shape, bytes_before, bytes_after, max_abs_error

    @property
    def saved_bytes(self) -> int:
        return sum(t["bytes_before"] - t["bytes_after"] for t in self.tables)

    def notes(self) -> list[str]:
        return [f"embedding {t['name']} {t['shape'][0]}x{t['shape'][1]} stored int{t['bits']} with per-row scales ({t['layout']}): "
                f"{t['bytes_before'] / 1e6:.2f} MB -> {t['bytes_after'] / 1e6:.2f} MB, max abs rounding error "
                f"{t['max_abs_error']:.3g}" + (f"; padding row {t['padding_row']} read as zeros (scale 0), the bags' mask "
                                                "multiply dropped" if t.get("padding_row") is not None else "")
                for t in self.tables]


def quantize_rows(table: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per row: ``q = round(table / scale)`` in [-L, L], ``scale = max|row| / L``, L = 127 for 8 bits and
    7 for 4 (1.0 for an all-zero row, which then stays exactly zero); ``q`` as int8 either way."""
    levels = LEVELS[bits]
    amax = np.abs(table).max(axis=1)
    scale = np.where(amax > 0, amax / float(levels), 1.0).astype(np.float32)
    q = np.clip(np.rint(table / scale[:, None]), -levels, levels).astype(np.int8)
    return q, scale


#: The largest magnitude of a row's values, per bit width (symmetric: -L..L, zero exact).
LEVELS = {8: 127, 4: 7}


def snap_embedding_tables(model, *, min_bytes: int = MIN_SNAP_BYTES, min_share: float = MIN_SHARE, bits: int = 8,
                          fields: bool = False) -> list[str]:
    """Put each ``nn.Embedding``/``nn.EmbeddingBag`` table the INT8 export is to store in int8 onto that grid, in
    place (``quantize_rows`` and back), and freeze it; returns the tables' names.

    The qat and ptq stages call it before inserting quantizers, so the quantized torch model they train and
    measure reads the rows the artifact will read: the export's ``quantize_embeddings(on_grid=True)`` finds
    exactly these tables (their rows are on a per-row int8 grid) and reproduces them without a further
    rounding. Without it, rounding the table at export (0.7 % of a row's norm on MiniLM-L6) changed 4 %
    of the SST-2 dev predictions of a QAT model against the torch model it was exported from (an FP32 model
    changed none): an INT8 transformer's coarse activation grids amplify any change of its input. Frozen
    because the rounding happens once; trained further, the table would leave its grid again.

    Selected: float32 tables of 2 columns or more (a width-1 table's scale would cost as much as its value)
    holding at least ``min_bytes`` or ``min_share`` of the INT8 model's bytes (weights of two or more
    dimensions counted at one byte, other tables and vectors at four); with ``fields`` (a ranker: one table a field,
    the qat and ptq stages say so) also any smaller table of the same width as one of those (a field with a handful of
    values beside the id tables: stored int8 too, its reads are stacked with theirs into one, ``stacked.py``, where in
    float it would split the run). A table also used elsewhere (a tied output projection) is left alone, as the
    export leaves it.
    """
    import torch
    from torch import nn

    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    tables = {id(m.weight) for _, m in embeddings}
    total = sum(p.numel() * (4 if p.dim() < 2 or id(p) in tables else 1) for p in model.parameters())
    storable = [(n, m) for n, m in embeddings
                if m.weight.dtype == torch.float32 and uses[id(m.weight)] == 1 and m.weight.shape[1] >= 2]
    big = {n for n, m in storable if m.weight.numel() * 4 >= min_bytes or m.weight.numel() * 4 / max(total, 1) >= min_share}
    widths = {m.weight.shape[1] for n, m in storable if n in big} if fields else set()
    snapped = []
    for name, module in storable:
        weight = module.weight
        if name not in big and weight.shape[1] not in widths:
            continue
        q, scale = quantize_rows(weight.detach().cpu().numpy(), bits)
        with torch.no_grad():
            weight.copy_(torch.from_numpy(q.astype(np.float32) * scale[:, None]))
        weight.requires_grad_(False)
        snapped.append(f"{name}.weight")
    return snapped


def grid_bits(table: np.ndarray) -> int | None:
    """4 or 8 when every row of ``table`` is ``q * scale`` with ``scale = max|row| / L`` (L = 7 or 127: what
    ``snap_embedding_tables`` leaves), else None (a trained float table practically never is)."""
    return next((bits for bits in (4, 8) if on_grid(table, bits)), None)


def on_grid(table: np.ndarray, bits: int = 8) -> bool:
    """Whether every row of ``table`` is exactly ``q * scale``, ``q`` in -L..L and ``scale = max|row| / L``."""
    q, scale = quantize_rows(table, bits)
    # within a thousandth of a step, not exactly: re-deriving the scale from a snapped row's max may move it by
    # an ulp; a float table's values sit anywhere within half a step of the grid
    return bool(np.all(np.abs(q.astype(np.float32) * scale[:, None] - table) <= 1e-3 * scale[:, None]))


def _candidates(model, min_bytes: int, min_share: float, snapped: bool = False) -> dict[str, int]:
    """Float32 rank-2 initializers read only as the data of axis-0 Gathers, big enough to quantize, with the bits
    to store them in: 8 (``snapped``: those whose rows are on an int8 or int4 grid instead, whatever their size)."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    total = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer) or 1
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in inits:
                readers.setdefault(name, []).append((node, k))
    graph_outputs = {o.name for o in model.graph.output}
    found: dict[str, int] = {}
    for name, uses in readers.items():
        t = inits[name]
        if t.data_type != TensorProto.FLOAT or len(t.dims) != 2 or name in graph_outputs:
            continue
        gathers = all(n.op_type == "Gather" and k == 0 and _axis(n) == 0 for n, k in uses)
        size = int(np.prod(t.dims)) * 4
        if not gathers or t.dims[1] < 2:
            continue
        bits = grid_bits(numpy_helper.to_array(t)) if snapped else (8 if size >= min_bytes or size / total >= min_share else None)
        if bits is not None:
            found[name] = bits
    return found


def _axis(node) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def quantize_embeddings(model, *, layout: Layout = "gather_rows", min_bytes: int = MIN_BYTES,
                        min_share: float = MIN_SHARE, on_grid: bool = False) -> EmbeddingReport:
    """Store each large Gather table of the ONNX ``model`` (a ModelProto, changed in place) as int8 with
    per-row scales; ``on_grid``: each table already on that grid (``snap_embedding_tables``: what the INT8
    export of a quantized model does), whatever its size. Tables also read by anything but an axis-0 Gather's
    data input (a tied output projection), and width-1 tables, are left alone. Needs opset >= 13
    (per-axis DequantizeLinear). A table snapped to the int4 grid (``snap_embedding_tables(bits=4)``) is stored
    packed two values a byte (``pack_int4``)."""
    from onnx import numpy_helper

    report = EmbeddingReport()
    graph = model.graph
    found = _candidates(model, min_bytes, min_share, on_grid)
    ranks = id_ranks(model) if found else {}
    for name, bits in found.items():
        init = next(t for t in graph.initializer if t.name == name)
        table = numpy_helper.to_array(init).astype(np.float32)
        q, scale = quantize_rows(table, bits)
        error = float(np.abs(q.astype(np.float32) * scale[:, None] - table).max())
        padding = _padding_masks(graph, name) if layout == "gather_rows" and bits == 8 else None
        if padding is not None:  # the padding row reads as zeros: the bags' masks are redundant
            pad, muls = padding
            scale[pad] = 0.0
            _bypass(graph, muls)
        graph.initializer.remove(init)
        new_inits = _rewrite(graph, name, q, scale, layout if bits == 8 else "int4", ranks)
        graph.initializer.extend(new_inits)
        after = sum(numpy_helper.to_array(t).nbytes for t in new_inits)
        report.tables.append({"name": name, "shape": list(table.shape), "layout": layout if bits == 8 else "int4",
                              "bits": bits, "bytes_before": table.nbytes, "bytes_after": after, "max_abs_error": error,
                              "padding_row": None if padding is None else padding[0]})
    return report


def id_ranks(model) -> dict[str, int]:
    """The rank of every tensor of ``model`` whose rank ONNX shape inference knows (an ids tensor's decides how its rows
    are dequantized: ``gather_rows``); empty where inference fails (a contrib op it has no schema for)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - an unknown rank only costs the faster form
        return {}
    infos = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    return {v.name: len(v.type.tensor_type.shape.dim) for v in infos if v.type.tensor_type.HasField("shape")}


def _padding_masks(graph, name: str) -> tuple[int, list] | None:
    """``(padding id, mask Muls)`` where every read of table ``name`` is a bag's padded read as ``bags.py`` writes it,
    ``Mul(Gather(name, ids), Cast(Unsqueeze(Not(Equal(ids, pad)), -1)))`` with one constant ``pad``, else None.

    With the padding row's scale set to 0 the int8 read itself yields zeros there, and the Mul (a float op on
    every gathered value) is dropped: exact, since a masked value is multiplied by 0 either way. The padding row is
    read by nothing else (the table's only readers are these bags). A bag's mean still counts its ids with the mask."""
    from onnx import numpy_helper

    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def const(t: str):
        return numpy_helper.to_array(inits[t]) if t in inits else None

    pads, muls = set(), []
    outputs = {o.name for o in graph.output}
    for gather in [n for n in graph.node if n.op_type == "Gather" and n.input[0] == name]:
        ids, rows = gather.input[1], gather.output[0]
        users = consumers.get(rows, [])
        if not users or rows in outputs:
            return None
        for mul in users:
            if mul.op_type != "Mul" or len(mul.input) != 2 or mul.output[0] in outputs:
                return None
            chain, node = [], producer.get(mul.input[1 - list(mul.input).index(rows)])
            for op in ("Cast", "Unsqueeze", "Not", "Equal"):
                if node is None or node.op_type != op:
                    return None
                chain.append(node)
                node = producer.get(node.input[0])
            unsqueeze, equal = chain[1], chain[3]
            axes = const(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else None
            if axes is None or axes.reshape(-1).tolist() != [-1] or ids not in equal.input:
                return None
            pad = const(equal.input[1 - list(equal.input).index(ids)])
            if pad is None or pad.size != 1:
                return None
            pads.add(int(pad.reshape(-1)[0]))
            muls.append(mul)
    if len(pads) != 1 or not muls:
        return None
    return pads.pop(), muls


def _bypass(graph, muls: list) -> None:
    """Drop each ``Mul(rows, mask)`` (its readers read ``rows``), then the mask ops nothing reads any more."""
    for mul in muls:
        rows = next(i for i in mul.input if any(n.op_type == "Gather" and n.output[0] == i for n in graph.node))
        for node in graph.node:
            node.input[:] = [rows if i == mul.output[0] else i for i in node.input]
        graph.node.remove(mul)
    outputs = {o.name for o in graph.output}
    constants = set()
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if n.op_type in ("Cast", "Unsqueeze", "Not", "Equal") and not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            constants.update(n.input)
            graph.node.remove(n)
    read = {i for n in graph.node for i in n.input} | outputs
    for t in [t for t in graph.initializer if t.name in constants and t.name not in read]:  # the pad id, the axes
        graph.initializer.remove(t)


def _rewrite(graph, name: str, q: np.ndarray, scale: np.ndarray, layout: str, ranks: dict[str, int] | None = None) -> list:
    """Replace the reads of table ``name`` by reads of its quantized rows ``q`` and ``scale``; the new initializers."""
    from onnx import helper, numpy_helper

    if layout == "int4":
        _gather_int4_rows(graph, name, q.shape[1])
        return [numpy_helper.from_array(pack_int4(q), f"{name}_int4"), numpy_helper.from_array(scale, f"{name}_scale")]
    new_inits = [numpy_helper.from_array(q, f"{name}_int8"), numpy_helper.from_array(scale, f"{name}_scale")]
    if layout == "dequantize_table":
        new_inits.append(numpy_helper.from_array(np.zeros(len(scale), np.int8), f"{name}_zero_point"))
        dq = helper.make_node("DequantizeLinear", [f"{name}_int8", f"{name}_scale", f"{name}_zero_point"], [name],
                              name=f"{name}_DequantizeLinear", axis=0)
        _insert_before_first_reader(graph, name, [dq])
    else:
        gather_rows(graph, name, ranks=ranks)
    return new_inits


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Two int4 values (-7..7) a byte: column j in the low nibble, column j + ceil(W/2) in the high one, each +8
    (so 1..15). Split by halves, not by neighbours, so unpacking is a Concat of the two nibbles with no Reshape."""
    half = (q.shape[1] + 1) // 2
    padded = np.zeros((q.shape[0], 2 * half), np.int16)
    padded[:, : q.shape[1]] = q
    return ((padded[:, :half] + 8) | ((padded[:, half:] + 8) << 4)).astype(np.uint8)


def _gather_int4_rows(graph, name: str, width: int) -> None:
    """Rewrite every ``Gather(name, ids)`` as a gather of packed int4 rows, unpacked with float arithmetic
    (``hi = floor(b / 16)``, ``lo = b - 16 hi``: Cast, Mul, Floor, Sub, Concat, Slice, all standard ONNX that
    onnxruntime and OpenVINO run; no BitShift/BitwiseAnd, whose uint8 support differs), minus 8, times the row's scale.
    Written by hand: ONNX's INT4 type needs opset 21 and onnxruntime reads it through DequantizeLinear of the
    whole table, the layout that made a ranker 9.9x slower at batch 1."""
    from onnx import TensorProto, helper, numpy_helper

    consts: dict[str, np.ndarray] = {f"{name}_sixteenth": np.array(1 / 16, np.float32), f"{name}_sixteen": np.array(16, np.float32),
              f"{name}_eight": np.array(8, np.float32), f"{name}_last_axis": np.array([-1], np.int64),
              f"{name}_zero": np.array([0], np.int64), f"{name}_width": np.array([width], np.int64)}
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    for i, node in enumerate([n for n in graph.node if n.op_type == "Gather" and n.input[0] == name]):
        out, ids, t = node.output[0], node.input[1], f"{name}_{i}"
        new = [
            helper.make_node("Gather", [f"{name}_int4", ids], [f"{t}_packed"], name=f"{t}_GatherRows", axis=0),
            helper.make_node("Cast", [f"{t}_packed"], [f"{t}_bytes"], name=f"{t}_Cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{t}_bytes", f"{name}_sixteenth"], [f"{t}_hi_frac"], name=f"{t}_Shift"),
            helper.make_node("Floor", [f"{t}_hi_frac"], [f"{t}_hi"], name=f"{t}_Floor"),
            helper.make_node("Mul", [f"{t}_hi", f"{name}_sixteen"], [f"{t}_hi16"], name=f"{t}_Back"),
            helper.make_node("Sub", [f"{t}_bytes", f"{t}_hi16"], [f"{t}_lo"], name=f"{t}_Low"),
            helper.make_node("Concat", [f"{t}_lo", f"{t}_hi"], [f"{t}_both"], name=f"{t}_Concat", axis=-1),
            helper.make_node("Slice", [f"{t}_both", f"{name}_zero", f"{name}_width", f"{name}_last_axis"], [f"{t}_cols"],
                             name=f"{t}_Slice"),
            helper.make_node("Sub", [f"{t}_cols", f"{name}_eight"], [f"{t}_rows"], name=f"{t}_Center"),
            helper.make_node("Gather", [f"{name}_scale", ids], [f"{t}_row_scale"], name=f"{t}_GatherScales", axis=0),
            helper.make_node("Unsqueeze", [f"{t}_row_scale", f"{name}_last_axis"], [f"{t}_row_scale_1"], name=f"{t}_Unsqueeze"),
            helper.make_node("Mul", [f"{t}_rows", f"{t}_row_scale_1"], [out], name=f"{t}_Mul"),
        ]
        index = list(graph.node).index(node)
        graph.node.remove(node)
        for offset, n in enumerate(new):
            graph.node.insert(index + offset, n)


def _insert_before_first_reader(graph, name: str, nodes: list) -> None:
    """Insert ``nodes`` (which produce ``name``) right before the first node reading it: topological order holds."""
    index = next(i for i, n in enumerate(graph.node) if name in n.input)
    for offset, node in enumerate(nodes):
        graph.node.insert(index + offset, node)


def gather_rows(graph, name: str, q: str | None = None, scale: str | None = None, ranks: dict[str, int] | None = None) -> None:
    """Rewrite every ``Gather(name, ids)`` as a gather of int8 rows (initializer ``q``, default ``<name>_int8``) and of
    their scales (``scale``, default ``<name>_scale``, one a row), dequantized. ``tied.py`` passes the int8 weight and
    per-row scales of the output projection a table is tied to.

    Ids of rank 1 (``ranks``, from ``id_ranks``: a ranker's one id a field) read ``DequantizeLinear(rows, row scales,
    axis=0)``, three ops a table; other ids (a sequence, a bag, or a rank not known) ``Cast`` the rows and ``Mul`` them
    by the ``Unsqueeze``d scales, five. Measured in onnxruntime 1.32, one thread, on an AVX-512 EPYC (a 20000 x 16 table,
    64 ids, ``session.run`` included): float Gather 6.1 us, DequantizeLinear 7.9 us, Cast + Mul 9.0 us,
    onnxruntime's own ``com.microsoft.GatherBlockQuantized`` 9.0 us (its kernel divides three times per value: 19.7 us
    against 14.5 us for Cast + Mul on 64 bags of 4 ids). OpenVINO converts both forms."""
    from onnx import TensorProto, helper, numpy_helper

    q, scale = q or f"{name}_int8", scale or f"{name}_scale"
    axes = f"{name}_last_axis"
    readers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] == name]
    if any((ranks or {}).get(n.input[1]) != 1 for n in readers):
        graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), axes))
    for i, node in enumerate(readers):
        out, ids, tag = node.output[0], node.input[1], f"{name}_{i}"
        rows = helper.make_node("Gather", [q, ids], [f"{tag}_rows_int8"], name=f"{tag}_GatherRows", axis=0)
        scales = helper.make_node("Gather", [scale, ids], [f"{tag}_row_scale"], name=f"{tag}_GatherScales", axis=0)
        if (ranks or {}).get(ids) == 1:
            new = [rows, scales, helper.make_node("DequantizeLinear", [rows.output[0], scales.output[0]], [out],
                                                  name=f"{tag}_Dequantize", axis=0)]
        else:
            new = [
                rows,
                helper.make_node("Cast", [f"{tag}_rows_int8"], [f"{tag}_rows"], name=f"{tag}_Cast", to=TensorProto.FLOAT),
                scales,
                helper.make_node("Unsqueeze", [f"{tag}_row_scale", axes], [f"{tag}_row_scale_1"], name=f"{tag}_Unsqueeze"),
                helper.make_node("Mul", [f"{tag}_rows", f"{tag}_row_scale_1"], [out], name=f"{tag}_Mul"),
            ]
        index = list(graph.node).index(node)
        graph.node.remove(node)
        for offset, n in enumerate(new):
            graph.node.insert(index + offset, n)


def is_row_dequantize(node, producer: dict) -> bool:
    """Whether ``node`` is a ``gather_rows`` DequantizeLinear: int8 rows by their gathered per-row scales (a table read,
    whose scale is data, not one of the Q/DQ convention's constants)."""
    if node.op_type != "DequantizeLinear" or len(node.input) < 2:
        return False
    rows, scales = producer.get(node.input[0]), producer.get(node.input[1])
    return (rows is not None and scales is not None and rows.op_type == "Gather" and scales.op_type == "Gather"
            and rows.input[1] == scales.input[1])


def component_bytes(model) -> dict[str, int]:
    """Bytes of an ONNX ``model``'s initializers by component: ``table_bytes``, what Gathers read rows of (embedding
    tables, float or int8/int4 with their per-row scales, or int8 through a DequantizeLinear: a table tied to an INT8
    output projection, ``tied.py``; counted once however many ops read it), and ``other_bytes`` (the MLP, attention,
    norms...)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    tables: set[str] = set()
    for node in model.graph.node:
        if node.op_type != "Gather":
            continue
        source = producer.get(node.input[0])
        if source is not None and source.op_type == "DequantizeLinear" and source.input[0] in inits:
            read = [i for i in source.input if i in inits]
        else:
            read = [node.input[0]]
        if read[0] in inits and len(inits[read[0]].dims) >= 1 and int(np.prod(inits[read[0]].dims)) > 64:
            tables.update(read)
    sizes = {name: numpy_helper.to_array(t).nbytes for name, t in inits.items()}
    in_tables = sum(v for k, v in sizes.items() if k in tables)
    return {"table_bytes": in_tables, "other_bytes": sum(sizes.values()) - in_tables}
