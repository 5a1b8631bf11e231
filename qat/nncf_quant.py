"""FakeQuantize insertion through NNCF: per-channel symmetric int8 weights, per-tensor activations,
ranges initialised from the calibration set, ignored scopes by module name or NNCF node regex."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import re
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from pruneflow.errors import ConfigError, StageError
from pruneflow.inputs import Inputs, bind, take, to

from pruneflow.calibrate.calibset import CalibrationSet
from pruneflow.calibrate.consumers import nncf_dataset

from .nncf_setup import ensure_built
from .settings import NncfSettings

if TYPE_CHECKING:
    from pruneflow.tasks import Task

log = logging.getLogger("pruneflow")


@contextlib.contextmanager
def quiet_nncf() -> Iterator[None]:
    """NNCF draws Rich progress bars on stdout and logs there; the CLI's stdout belongs to --json."""
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.ERROR)
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        nncf_log.setLevel(level)
        if buffer.getvalue().strip():
            log.debug("nncf: %s", buffer.getvalue().strip()[-2000:])


class SequentialRoot(nn.Module):
    """A plain module around a model whose top module is an ``nn.Sequential``.

    NNCF stores its quantizer hooks as a child module of the model it quantizes; an ``nn.Sequential``
    runs every child in turn, that one too, and NNCF then fails with ``Module [HookStorage] is missing
    the required "forward" function``. Under this root the Sequential is an ordinary child. Its module
    names gain the prefix ``model.`` (``ignore`` entries are written without it and translated).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        # One named input, as a Sequential takes: NNCF's input quantizer hooks onto the root's argument by name.
        return self.model(x)


def rooted(model: nn.Module) -> tuple[nn.Module, str]:
    """The module to hand NNCF and the prefix its module names gain (``SequentialRoot`` for a Sequential top)."""
    if isinstance(model, nn.Sequential):
        return SequentialRoot(model), "model."
    return model, ""


def _matched_modules(names: list[str], item: str) -> list[str]:
    """Module names an ``ignore`` entry selects: itself, or every name the entry matches whole as a regex
    (``layers\\.0\\..*``, ``features.[0-3]``), outermost only (ignoring a module ignores what it holds)."""
    if item in names:
        return [item]
    try:
        rx = re.compile(item)
    except re.error:
        return []
    found = [n for n in names if rx.fullmatch(n)]
    return [n for n in found if not any(n.startswith(f + ".") for f in found)]


def ignore_patterns(model: nn.Module, ignore: list[str], loc: tuple, prefix: str = "", node_names: "set[str] | None" = None) -> list[str]:
    """NNCF node-name regexes for the recipe's ``ignore`` entries: module names and regexes over module
    names (dotted, as ``named_modules`` writes them; NNCF's node names use ``/``), or NNCF node-name regexes
    (checked against ``node_names`` when given). An entry that selects nothing is a ConfigError naming the
    entry and the closest module names: ignoring nothing silently would quantize what the user meant to keep float.
    """
    import difflib

    names = [n for n, _ in model.named_modules() if n]
    patterns = []
    for i, item in enumerate(ignore):
        modules = _matched_modules(names, item)
        if modules:
            patterns += [f"^{re.escape((prefix + n).replace('.', '/'))}(/.*)?$" for n in modules]
            continue
        try:
            rx = re.compile(item)
        except re.error as exc:
            raise ConfigError((*loc, i), f"neither a module name nor a valid regex ({exc})", value=item,
                              hint="use a module name from `pruneflow inspect` (e.g. `features.3`), or a valid regex") from exc
        if node_names is not None and not any(rx.match(n) for n in node_names):
            close = difflib.get_close_matches(item, names, n=3, cutoff=0.3) or names[:3]
            raise ConfigError((*loc, i), f"{item!r} matches no module of the model and no NNCF node name", value=item,
                              hint=f"closest module names: {', '.join(close)}; a regex must match a whole dotted "
                              "module name (`blocks\\.1\\..*`)")
        patterns.append(item)
    return patterns


def ignored_scope(model: nn.Module, ignore: list[str], loc: tuple = ("ignore",), prefix: str = "", node_names: "set[str] | None" = None):
    """NNCF IgnoredScope for the recipe's ``ignore`` (see ``ignore_patterns``), or None when it is empty."""
    import nncf

    if not ignore:
        return None
    return nncf.IgnoredScope(patterns=ignore_patterns(model, ignore, loc, prefix, node_names), validate=True)


def node_names(model: nn.Module, example: Inputs) -> set[str]:
    """The node names of NNCF's graph of ``model`` (what its ignored-scope regexes match)."""
    from nncf.torch.function_hook.nncf_graph.nncf_graph_builder import build_nncf_graph

    with torch.no_grad():
        graph = build_nncf_graph(model, example)
    return {node.node_name for node in graph.get_all_nodes()}


def is_ranker(model: nn.Module) -> bool:
    """Embedding tables, no attention and no convolution: a ranker (DeepFM, DLRM, MMoE) or a recurrent sequence model,
    whose tables are read one id (or one bag) a field."""
    tables = any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules())
    return tables and not has_attention(model) and not any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` holds attention modules: torch's (``nn.MultiheadAttention``, transformer layers),
    pruneflow's ``HeadAttention`` or a library's (a class whose name ends in ``Attention`` and that holds Linear
    projections, as transformers' ``BertSelfAttention`` and timm's ``Attention`` do; a CNN's convolutional
    "channel attention" gate does not count)."""
    torch_types = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)

    def projected(m: nn.Module) -> bool:
        return type(m).__name__.endswith("Attention") and any(isinstance(c, nn.Linear) for c in m.modules())

    return any(isinstance(m, torch_types) or projected(m) for m in model.modules())


def resolve_model_type(model: nn.Module, model_type: str) -> str:
    """``auto`` → ``transformer`` for a text transformer (attention, ``has_attention``, over token embeddings,
    ``nn.Embedding``) and for a ranker (embedding tables and no convolution), else ``cnn``.

    For a ranker, NNCF's transformer type is what it says of the ops: only Linear/MatMul inputs quantized, the
    elementwise interactions kept float. Under ``cnn`` a DeepFM's factorisation-machine term, a difference of
    two squared sums, was computed from per-tensor int8 grids: on UCI Adult (recipes/adult-ctr.yaml) the mean
    predicted CTR moved by 0.0082 against the FP32 model (|pCTR - rate| 0.0004 -> 0.0086) while AUC moved
    0.0003; under ``transformer`` it moved 0.0001 and AUC 0.0001.

    A vision transformer stays ``cnn``: under NNCF's transformer type its pre-norm residual stream is left
    unquantized, and TensorRT's explicit-quantization convention refuses a residual Add with one float input
    (measured on tests/families/vit.py: the tensorrt INT8 form fails its convention check); the ``cnn`` type
    exports both forms. ``model_type: transformer`` still asks for it.
    """
    if model_type != "auto":
        return model_type
    tokens = any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules())
    convolutions = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return "transformer" if tokens and (has_attention(model) or not convolutions) else "cnn"


def quantize(model: nn.Module, calib: CalibrationSet, settings: NncfSettings | None = None, *,
             ignore_loc: tuple = ("ignore",), task: Task | None = None) -> nn.Module:
    """Insert FakeQuantize operations and set their ranges from ``calib``, as ``settings`` say (default:
    ``NncfSettings()``; a qat/ptq stage passes its config). Returns the quantized model (under a
    ``SequentialRoot`` when the model's top module is an ``nn.Sequential``).

    ``ignore_loc``: the recipe key path of ``ignore`` (the stage's ``self.loc("ignore")``), for the error
    when an entry selects nothing.

    ``activations="signed"`` forces every activation quantizer to int8 (-128..127, zero point 0), the
    only activation type TensorRT accepts; the CPU INT8 form writes the same grid as uint8 (zero point 0
    and a Clip at 127 after a ReLU, zero point 128 elsewhere), so one set of trained scales serves both
    (pruneflow/export/qdq/). ``"auto"`` lets
    NNCF use unsigned quantizers after ReLU (one more bit there, but no exact TensorRT form).

    ``model_type``: ``transformer`` uses NNCF's transformer model type (see ``nncf_quantize``), ``cnn`` its
    default, ``auto`` the former for text transformers (``resolve_model_type``). ``smooth_quant``: SmoothQuant's
    alpha under the transformer type (None: off; see ``transformer_arguments``). ``ranges: auto`` takes the
    activation ranges ``task`` asks for (``Task.ranges``; NNCF's default without a task).
    """
    settings = settings or NncfSettings()
    batch_size = settings.batch_size
    ensure_built()
    params = next(model.parameters(), None)
    dataset = nncf_dataset(calib, batch_size, device=str(params.device) if params is not None else None)
    items = -(-len(calib) // batch_size)
    first = to(next(calib.batches(batch_size)), params.device if params is not None else "cpu")
    was = model.training
    try:
        quantized = nncf_quantize(model, dataset, items, first, settings, ignore_loc, resolve_ranges(settings.ranges, task))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - tracing failures come in many types
        where = failing_module(model, exc)
        raise StageError(
            f"NNCF could not quantize the model{f' (failed in module {where!r})' if where else ''}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            hint="the qat/ptq preflight traces the model before any training and names the module and the "
            "`ignore` entry that avoids it; this failure came later, with the calibration data: report it with the model",
        ) from exc
    if settings.activations == "signed":
        force_signed_activations(quantized)
    quantized.train(was)
    return quantized


def deepcopyable_property_getters() -> None:
    """Let ``copy.deepcopy`` pass a property getter (a ``method-wrapper``) through as it is.

    NNCF records every tensor operation of the traced model in its graph, a tensor property read included: a
    tied output ``h @ table.weight.T`` becomes a ``__get__`` node whose layer attributes hold
    ``Tensor.T.__get__``, a method-wrapper of a C ``getset_descriptor``. The min-max algorithm then deep-copies
    the graph (``find_quantization_setup``), and a method-wrapper cannot be pickled: ``TypeError: cannot pickle
    'getset_descriptor' object``, for every model type, whatever the model's inputs (issue 37 met it on a SASRec
    scoring against its item table). A method-wrapper is immutable and bound to its object, so copying it as
    itself, as ``deepcopy`` already does for functions and types, is the right copy; NNCF 3.4 has no switch for it.
    """
    import copy
    import types

    copy._deepcopy_dispatch.setdefault(types.MethodWrapperType, copy._deepcopy_atomic)  # type: ignore[attr-defined]


def resolve_ranges(ranges: str, task: Task | None) -> str:
    """``ranges`` with ``auto`` resolved: what ``task`` asks for (``Task.ranges``), NNCF's default without one."""
    if ranges != "auto":
        return ranges
    return task.ranges() if task is not None else "mean_minmax"


def nncf_quantize(model: nn.Module, dataset, items: int, example: Inputs, settings: NncfSettings, ignore_loc: tuple,
                  ranges: str = "mean_minmax") -> nn.Module:
    """``nncf.quantize`` on ``model`` (rooted, see ``SequentialRoot``) with ``settings`` (its ``ignore`` resolved, its
    ``model_type`` resolved on ``model``: ``resolve_model_type``); a TorchScript module or an ``ignore`` entry
    selecting nothing is a ConfigError, anything else NNCF raises comes out as it is.

    Model type ``transformer``: NNCF's ``ModelType.TRANSFORMER`` (Linear inputs and the attention score
    MatMul's inputs quantized; LayerNorm, Softmax, GELU and the context MatMul kept float; no quantizer on
    the int64 token inputs), with embedding lookups left out (``types: [embedding]``: the word-embedding
    table is stored int8 weight-only by pruneflow/export/embedding.py instead) and SmoothQuant at alpha
    ``settings.smooth_quant`` (see ``transformer_arguments``).

    ``ranges`` (resolved: ``resolve_ranges``): ``minmax`` sets every activation quantizer's range from the extremes
    of all calibration batches (NNCF's ``RangeEstimatorParametersSet.MINMAX``), ``mean_minmax`` is NNCF's default
    for activations (the mean over batches of each batch's extremes).
    """
    import nncf

    deepcopyable_property_getters()
    ignore, model_type = settings.ignore, resolve_model_type(model, settings.model_type)
    refuse_scripted(model, ignore_loc[:-1])
    attention_fastpath_off(model)
    root, prefix = rooted(model)
    root.eval()
    names = [n for n, _ in model.named_modules() if n]
    nodes = node_names(root, example) if any(not _matched_modules(names, i) for i in ignore) else None
    scope = without_tables(model, ignored_scope(model, ignore, ignore_loc, prefix, nodes), root, example, prefix)
    kwargs = {} if model_type != "transformer" else transformer_arguments(model, scope, settings.smooth_quant)
    if ranges == "minmax":
        from dataclasses import replace

        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters
        from nncf.quantization.range_estimator import RangeEstimatorParametersSet

        advanced = kwargs.get("advanced_parameters") or AdvancedQuantizationParameters()
        kwargs["advanced_parameters"] = replace(advanced, activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX)
    try:
        with quiet_nncf():
            quantized = nncf.quantize(root, dataset, subset_size=items, preset=nncf.QuantizationPreset(settings.preset),
                                      **{"ignored_scope": scope, **kwargs})
    except nncf.ValidationError as exc:
        raise ConfigError(ignore_loc, str(exc).strip(), hint="use module names from `pruneflow inspect`, or NNCF node-name regexes") from exc
    freeze_smoothing(quantized)
    return quantized


def without_tables(model: nn.Module, scope, root: nn.Module | None = None, example: Inputs | None = None, prefix: str = ""):
    """``scope`` that also leaves every embedding lookup out of NNCF's quantization (None: nothing ignored), and
    the projection of a table whose width was pruned (``prune/tables.py``: its rows are stored at rank r and
    projected back; quantizing the projection's input per tensor cost a DeepFM 0.0016 AUC against its FP32
    model, ignored 0.0000), found in NNCF's graph of ``root`` on ``example`` as the node reading the projection.

    NNCF gives an ``nn.Embedding``'s weight one per-tensor int8 scale, and a ranker's tables all the same one
    when their rows meet in a concat (measured on an 8-field DeepFM: one scale for all eight tables, a few
    dozen of 255 levels used by each; a DeepFM's mean predicted CTR rose from 0.352 to 0.386 while AUC hardly
    moved). The tables are stored int8 with one scale per row instead (``snap_embedding_tables`` before
    quantizing, ``export/embedding.py`` in the artifact)."""
    import nncf

    if not any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules()):
        return scope
    patterns = list(scope.patterns) if scope is not None else []
    names = projection_nodes(model, root, example, prefix) if root is not None and example is not None else []
    return nncf.IgnoredScope(names=names, patterns=patterns, types=["embedding", "embedding_bag"], validate=False)


def projection_nodes(model: nn.Module, root: nn.Module, example: Inputs, prefix: str = "") -> list[str]:
    """NNCF node names of the ops reading a pruned table's projection (``CompactEmbedding.projection``)."""
    from pruneflow.prune.tables import CompactEmbedding

    params = {f"{prefix}{n}.projection" for n, m in model.named_modules() if isinstance(m, CompactEmbedding) and m.projected}
    if not params:
        return []
    from nncf.torch.function_hook.nncf_graph.nncf_graph_builder import build_nncf_graph

    with torch.no_grad():
        graph = build_nncf_graph(root, example)
    return sorted({edge.to_node.node_name for node in graph.get_all_nodes() if node.node_name in params
                   for edge in graph.get_output_edges(node)})


def transformer_arguments(model: nn.Module, scope, smooth_quant: float | None) -> dict:
    """``nncf.quantize`` arguments for ``model_type="transformer"`` (see ``nncf_quantize``).

    SmoothQuant (NNCF's, alpha 0.95 is its default for transformers): a pretrained BERT's LayerNorm outputs
    reach 30 in a few channels while most stay under 2, so one per-tensor int8 scale leaves most
    channels two or three levels, and the quantized model sits so close to its rounding boundaries that
    onnxruntime and OpenVINO, rounding a few ties differently, moved 1.6 % of MiniLM-SST-2's predictions.
    Per-channel scales s (x / s before the quantizer, W * s in the weights) even the channels out first.
    Measured on MiniLM-L6 SST-2 PTQ (dev, 872): predictions changed against FP32 3.67 % off, 1.15 % at 0.95
    (4.47 % at 0.5); onnxruntime vs OpenVINO f32 0.34 % vs 0.11 %. The Mul stays in the ONNX graph
    (onnxruntime: +8 % latency at batch 32; OpenVINO folds it)."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    alpha = -1 if smooth_quant is None else smooth_quant  # NNCF: a negative alpha turns SmoothQuant off
    advanced = AdvancedQuantizationParameters(smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=alpha))
    return {"model_type": nncf.ModelType.TRANSFORMER, "ignored_scope": scope, "advanced_parameters": advanced}


def _smoothing(model: nn.Module) -> list[nn.Module]:
    """NNCF's SmoothQuant hooks in ``model`` (``SQMultiply``: one per rescaled quantized input)."""
    from nncf.torch.quantization.layers import SQMultiply

    return [m for m in model.modules() if isinstance(m, SQMultiply)]


def smoothed_inputs(model: nn.Module) -> int:
    """How many quantized inputs SmoothQuant rescaled in ``model``."""
    return len(_smoothing(model))


def freeze_smoothing(model: nn.Module) -> None:
    """Freeze the SmoothQuant scales NNCF inserted (each an ``nn.Parameter``): they were computed with the
    weights they divide, so QAT trains the weights and the quantizer ranges, not them."""
    for hook in _smoothing(model):
        hook.scale.requires_grad_(False)


def attention_fastpath_off(model: nn.Module) -> None:
    """Turn torch's fused attention fast path off for this process when ``model`` has attention modules.

    In eval mode without gradients, ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` run one
    fused kernel that never calls the linear ops NNCF hooks its quantizers onto: NNCF would trace (and
    quantize) a different graph from the one that is trained and exported, and evaluation would skip the
    projections' weight quantizers. torch's own switch (``torch.backends.mha``) makes them run as composite ops.
    """
    if any(isinstance(m, (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) for m in model.modules()):
        if torch.backends.mha.get_fastpath_enabled():
            log.info("attention modules: torch's fused attention fast path turned off (it bypasses quantizers)")
        torch.backends.mha.set_fastpath_enabled(False)


def refuse_scripted(model: nn.Module, stage_loc: tuple) -> None:
    """NNCF cannot trace TorchScript modules (it fails inside them, and ignoring them does not help)."""
    scripted = [name for name, m in model.named_modules() if name and isinstance(m, torch.jit.ScriptModule)]
    scripted = [n for n in scripted if not any(n.startswith(f"{outer}.") for outer in scripted)]  # outermost only
    if scripted or isinstance(model, torch.jit.ScriptModule):
        kind = type(model.get_submodule(scripted[0]) if scripted else model).__name__
        raise ConfigError(
            stage_loc, f"NNCF cannot quantize TorchScript modules, and the model has "
            f"{', '.join(map(repr, scripted[:3])) or 'a scripted root'} ({kind}); `ignore` does not help, NNCF traces "
            "the whole model", hint="build the model from its Python class instead of torch.jit.script/torch.jit.load, "
            "or drop the qat/ptq stage (and int8 from export)",
        )


def failing_module(model: nn.Module, exc: BaseException) -> str | None:
    """The name of the innermost module of ``model`` whose code was running when ``exc`` was raised."""
    import traceback

    names = {id(m): n for n, m in model.named_modules() if n}
    found = None
    seen: set[int] = set()
    link: BaseException | None = exc  # then its cause or context, down the chain
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        for frame, _ in traceback.walk_tb(link.__traceback__):
            owner = frame.f_locals.get("self")
            if id(owner) in names:
                found = names[id(owner)]
        link = link.__cause__ or link.__context__
    return found


def force_signed_activations(model: nn.Module) -> int:
    """Make every symmetric activation quantizer signed (int8, zero point 0), per-tensor or per-channel (NNCF's
    choice before depthwise convolutions); returns how many changed.

    NNCF's hardware configs do not let `signedness_to_force` constrain activations, so this is done
    on the inserted quantizers: an unsigned one covering [0, s] in 256 steps becomes [-s·128/127, s]
    in steps of s/127 (the same scale parameter, half the resolution for non-negative inputs), which is
    what TensorRT would run anyway. QAT then trains with the grid that is exported.
    """
    from nncf.torch.quantization.layers import SymmetricQuantizer

    changed = 0
    for module in model.modules():
        # per-channel ones too (NNCF's choice before depthwise convolutions); weight quantizers are signed already
        if isinstance(module, SymmetricQuantizer) and not module.signed:
            module.signed = True
            changed += 1
    return changed


def strip_quantizers(model: nn.Module, example: Inputs) -> nn.Module:
    """A CPU copy of ``model`` with NNCF's quantizers replaced by torch's native fake-quant ops.

    torch.onnx writes those as QuantizeLinear/DequantizeLinear pairs, the input of pruneflow's INT8 passes
    (pruneflow/export/qdq/). The live model may be on a GPU and still in use, hence the copy.
    """
    import warnings

    import nncf

    from nncf.torch.function_hook.wrapper import get_hook_storage

    copied = copy.deepcopy(model).cpu().eval()
    hooks = dict(get_hook_storage(copied).named_hooks(remove_duplicate=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = bind(copied, to(take(example, slice(0, 1)), "cpu"))
        stripped = nncf.strip(copied, do_copy=False, example_input=one).eval()
    _strip_shared_quantizers(stripped, hooks)
    return stripped


def _strip_shared_quantizers(stripped: nn.Module, before: dict[str, nn.Module]) -> None:
    """Finish ``nncf.strip`` for quantizers shared by several hooks (unified scales: the inputs of a Concat).

    NNCF 2.x's strip walks the hooks with ``remove_duplicate=True``, so a shared quantizer is replaced at its
    first hook only and stays an NNCF quantizer at the others; torch.onnx then writes it as an
    ``org.openvinotoolkit`` FakeQuantize node that onnxruntime cannot load (issue 15: tests/families/two_input.py,
    whose image and metadata branches meet in a Concat). Each such hook gets the replacement its twin got."""
    from nncf.torch.function_hook.wrapper import get_hook_storage
    from nncf.torch.quantization.layers import BaseQuantizer

    storage = get_hook_storage(stripped)
    now = dict(storage.named_hooks(remove_duplicate=False))
    replaced = {id(before[n]): m for n, m in now.items() if n in before and m is not before[n]}
    for name, module in now.items():
        if isinstance(module, BaseQuantizer) and id(module) in replaced:
            storage.set_submodule(name, replaced[id(module)])


def quantizer_parameters(model: nn.Module) -> list:
    """The trainable range parameters NNCF added (frozen late in QAT)."""
    return [p for n, p in model.named_parameters() if "__nncf_hooks" in n and p.is_floating_point() and p.requires_grad]
