"""What varies is a registered kind, read from the class that declares it (issue 23, item 2).

- no string comparison on a pruning criterion, a stage type or a task name outside the registries (read from the
  source with ``ast``, nothing imported): a new kind is one class and a registration, not a switch to extend;
- a third-party pruning criterion, registered like a stage, is what a prune stage scores with;
- a stage's capabilities (``runs_under_ddp``), its checks on the model (``check_model``) and its doctor rows
  (``doctor``) are read from the stage class, for a third party's stage as for ours.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Literal

import pytest
import torch
from pydantic import Field, ValidationError
from torch import nn

from pruneflow import registry
from pruneflow.errors import ConfigError, PruneflowError
from pruneflow.stage import Check, Stage, StageConfig, StageResult

from conftest import stages_registered, tiny_recipe_dict, write

ROOT = Path(__file__).resolve().parents[1]
#: The library, the plugins and the CLI; registry.py holds the registries themselves.
SOURCES = [p for top in ("pruneflow", "qat", "calibrate") for p in sorted((ROOT / top).rglob("*.py"))] + [ROOT / "cli.py"]
EXEMPT = {"pruneflow/registry.py"}
#: Names whose comparison with a string means "which kind is this": a stage's or a config's ``type``, a criterion.
KIND_ATTRIBUTES = {"type", "importance", "criterion", "stage_type"}


def _kind_names() -> set[str]:
    """Criteria and tasks: names that mean nothing else, so comparing anything with one is a switch on it. (Stage
    type names double as split names and stage ids, ``split == "train"``: they are caught through ``.type``.)"""
    return set(registry.criteria.names()) | set(registry.tasks.names())


def _strings(node: ast.AST) -> list[str] | None:
    """The string(s) a constant, a literal tuple/list/set or a dict literal's keys hold; None when it holds none."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    elements = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
    found = [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return found or None


def _names_a_kind(node: ast.AST) -> bool:
    """``x.type``, ``cfg.importance``, ``criterion``...: an expression that holds the name of a registered kind."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name in KIND_ATTRIBUTES


def kind_switches(source: str, where: str, kinds: set[str], stage_types: frozenset[str] = frozenset()) -> list[str]:
    """``where:line  code`` for each comparison that switches on a kind's name: a kind-holding expression compared
    with a string (or a literal collection of them, or a module constant), or anything compared with a registered
    kind's name (``kinds``); and each literal collection (or dict of handlers) naming two or more of those or of
    ``stage_types`` (``{"train", "prune"}``)."""
    found = []
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_kind(s) for s in sides) and any(
                    _strings(s) is not None or (isinstance(s, ast.Name) and s.id.isupper()) for s in sides):
                found.append(node)
            elif any(set(_strings(s) or ()) & kinds for s in sides):
                found.append(node)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            named = _strings(node)
            if named is not None and len(set(named) & (kinds | stage_types)) >= 2:
                found.append(node)
    return list(dict.fromkeys(f"{where}:{n.lineno}  {lines[n.lineno - 1].strip()}" for n in found))


def test_no_string_switch_on_a_criterion_stage_type_or_task_name():
    kinds, stage_types = _kind_names(), frozenset(registry.stages.names())
    assert {"magnitude", "hessian+taylor"} <= kinds and {"train", "prune", "export"} <= stage_types
    found = [hit for path in SOURCES if path.relative_to(ROOT).as_posix() not in EXEMPT
             for hit in kind_switches(path.read_text(), path.relative_to(ROOT).as_posix(), kinds, stage_types)]
    assert not found, ("a kind is chosen by comparing its name: give the class an attribute or a method and ask it "
                       "through the registry instead:\n" + "\n".join(found))


@pytest.mark.parametrize("planted", [
    'if cfg.importance == "taylor":\n    pass\n',
    'if stage.config.type in ("train", "prune"):\n    pass\n',
    'DDP = frozenset({"train", "prune", "qat"})\n',
    'ok = s.type in DDP_STAGE_TYPES\n',
    'if criterion != "hessian+taylor":\n    pass\n',
    'if scored not in (None, "magnitude", "taylor"):\n    pass\n',
    'BUILTIN = {"train": check_train, "export": check_export}\n',
])
def test_the_scan_finds_a_planted_switch(planted):
    assert kind_switches(planted, "planted.py", _kind_names(), frozenset(registry.stages.names())), planted


def test_the_scan_leaves_other_strings_alone():
    clean = ('if config.split == "train":\n    pass\n'
             'if node.op_type == "Conv":\n    pass\n'
             'if precision == "fp16" and "fp32" in precisions:\n    pass\n'
             'criterion = registry.criteria.get(config.importance)\n')
    assert kind_switches(clean, "clean.py", _kind_names(), frozenset(registry.stages.names())) == []


# --------------------------------------------------------------------------- formats and runtimes

#: What knows a format, runtime or target by name: the formats package (the kinds themselves) and the registries.
FORMAT_ROOMS = ("pruneflow/formats/", "pruneflow/registry.py")
#: Places the scan may find and that are still to be fixed (``path  code``); the scan must find exactly these. Empty:
#: the INT8 Q/DQ passes read a form's declared ``Convention`` (``export/qdq/graph.py``), not its name.
KNOWN_FORM_SWITCHES: set[str] = set()


def format_switches(source: str, where: str, names: set[str], suffixes: set[str]) -> list[str]:
    """``where  code`` for each place that tells formats, runtimes or targets apart by name: a comparison with one of
    their ``names`` or a file ``suffixes`` (``runtime == "openvino"``, ``path.suffix in (".onnx", ".xml")``,
    ``form != "tensorrt"``), an ``endswith``/``with_suffix`` on a suffix, a dict literal keyed by two or more."""
    found = []
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            hit = any(set(_strings(s) or ()) & (names | suffixes) for s in [node.left, *node.comparators])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("endswith", "with_suffix"):
            hit = any(set(_strings(a) or ()) & suffixes for a in node.args)
        elif isinstance(node, ast.Dict):
            hit = len(set(_strings(node) or ()) & (names | suffixes)) >= 2
        else:
            continue
        if hit:
            found.append(f"{where}  {lines[node.lineno - 1].strip()}")
    return list(dict.fromkeys(found))


def _format_names() -> tuple[set[str], set[str]]:
    from pruneflow.formats import suffixes

    return set(registry.formats.names()) | set(registry.runtimes.names()) | set(registry.targets.names()), set(suffixes())


def test_no_string_switch_on_a_runtime_format_or_target_name_outside_the_formats():
    names, suffixes = _format_names()
    assert {"onnx", "openvino", "tensorrt", "ascend", "onnxruntime"} <= names and {".onnx", ".xml", ".engine", ".om"} <= suffixes
    found = {hit for path in SOURCES if not path.relative_to(ROOT).as_posix().startswith(FORMAT_ROOMS)
             for hit in format_switches(path.read_text(), path.relative_to(ROOT).as_posix(), names, suffixes)}
    assert found == KNOWN_FORM_SWITCHES, ("a format, runtime or target is told apart by its name: ask its registered kind "
                                          "(pruneflow.formats: format_of, runtime_named, runs_elsewhere) instead.\nnew: "
                                          + "\n".join(sorted(found - KNOWN_FORM_SWITCHES)) + "\nfixed (drop from KNOWN_FORM_SWITCHES): "
                                          + "\n".join(sorted(KNOWN_FORM_SWITCHES - found)))


@pytest.mark.parametrize("planted", [
    'if runtime == "openvino":\n    pass\n',
    'if executor.runtime != "onnxruntime":\n    pass\n',
    'record = read_ir(p) if p.suffix == ".xml" else read_onnx(p)\n',
    'ok = path.suffix in (".onnx", ".xml")\n',
    'irs = [a for a in artifacts if a.path.endswith(".xml")]\n',
    'if artifact.target not in ("onnx", "openvino"):\n    pass\n',
    'DEVICES = {"onnxruntime": {"cpu": "cpu"}, "openvino": {"cpu": "CPU"}}\n',
])
def test_the_format_scan_finds_a_planted_switch(planted):
    assert format_switches(planted, "planted.py", *_format_names()), planted


def test_the_format_scan_leaves_other_strings_alone():
    clean = ('if precision == "fp16" and "fp32" in precisions:\n    pass\n'
             'require("onnx", "pip install onnx", "the onnx target")\n'
             'fmt = format_of(path)\nif fmt is not None and fmt.emulates_cpus:\n    pass\n')
    assert format_switches(clean, "clean.py", *_format_names()) == []


def test_a_registry_finds_its_built_ins_where_no_entry_point_names_them_and_an_entry_point_wins():
    from pruneflow.formats.onnx import OnnxFormat
    from pruneflow.registry import Registry

    fresh = Registry("artifact format", "pruneflow.no_such_group", built_in={"onnx": "pruneflow.formats.onnx:OnnxFormat"})
    assert fresh.names() == ["onnx"] and fresh.get("onnx") is OnnxFormat
    shadowed = Registry("stage type", "pruneflow.stages", built_in={"train": "pruneflow.formats.onnx:OnnxFormat"})
    assert shadowed.get("train") is registry.stages.get("train")  # the installed entry point, not the listed built-in


def test_the_built_in_formats_and_runtimes_are_registered_kinds():
    from pruneflow.formats import Format, Runtime, format_of, runtime_named, runtimes_for

    for name in ("onnx", "openvino", "tensorrt", "ascend"):
        assert issubclass(registry.formats.get(name), Format) and registry.formats.get(name).name == name
    for name in ("onnxruntime", "openvino", "tensorrt"):
        assert issubclass(registry.runtimes.get(name), Runtime) and runtime_named(name).name == name
    assert format_of("a/model.int8.xml").name == "openvino" and format_of("m.plan").name == "tensorrt"
    assert format_of("m.bin") is None and runtimes_for("m.om") == () and runtimes_for("m.onnx") == ("onnxruntime", "openvino")
    assert runtime_named("openvino").takes_precision_hint and not runtime_named("onnxruntime").takes_precision_hint
    with pytest.raises(PruneflowError, match="unknown runtime 'tflite'.*known runtimes: onnxruntime, openvino, tensorrt"):
        runtime_named("tflite")


# --------------------------------------------------------------------------- criteria


class Smallest:
    """A third party's criterion: the *smallest* weights matter most (the opposite of magnitude)."""

    slow = False
    calls: list[str] = []

    @classmethod
    def from_config(cls, config):
        return cls()

    def score(self, evidence):
        Smallest.calls.append(type(evidence).__name__)
        return {n: 1.0 / (m + 1e-12) for n, m in evidence.magnitude().items()}


def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


def test_the_built_in_criteria_are_registered_classes():
    from pruneflow.prune.criteria import Criterion

    for name in ("magnitude", "taylor", "hessian", "hessian+taylor"):
        assert issubclass(registry.criteria.get(name), Criterion), name
    assert registry.criteria.get("hessian").slow and not registry.criteria.get("taylor").slow


def test_a_registered_criterion_is_what_the_prune_stage_scores_with():
    from pruneflow.prune.config import ChannelPruneConfig
    from pruneflow.prune.stage import PruneStage

    with pytest.raises(ValidationError, match="unknown pruning criterion 'smallest'.*known pruning criteria: hessian"):
        ChannelPruneConfig(target={"ratio": 0.25}, importance="smallest")
    Smallest.calls.clear()
    with registry.criteria.registered("smallest", Smallest):
        cfg = ChannelPruneConfig(target={"ratio": 0.25}, rounds=1, importance="smallest", finetune=None, latency=None)
        model, example = _conv_model(), torch.zeros(1, 1, 8, 8)
        strategy = PruneStage(cfg, "prune", 0).strategy(model, example, nn.functional.cross_entropy)
        strategy.entering()
        strategy.prepare()
        first = model[0].weight.detach().flatten(1).pow(2).sum(1)
        scores = strategy.score(lambda: pytest.fail("magnitude-based: no importance batches are sampled"))
        assert Smallest.calls == ["ChannelEvidence"]
        strategy.plan(scores, strategy.goal(1, 1)).apply()
    # the first conv kept its channels with the smallest weights, which magnitude would have removed
    assert model[0].out_channels < 8
    kept = sorted(first.argsort()[: model[0].out_channels].tolist())
    assert torch.allclose(model[0].weight.detach().flatten(1).pow(2).sum(1), first[kept])


def test_a_registered_criterion_scores_attention_heads_too():
    from pruneflow.prune.transformer import unit_importance

    pytest.importorskip("transformers")
    from pruneflow.zoo.hf import bert_classifier

    model = bert_classifier(num_layers=1, hidden_size=16, num_heads=4, intermediate_size=32, vocab_size=50, seed=0)
    Smallest.calls.clear()
    heads, ffn = unit_importance(model, lambda: pytest.fail("not sampled"), nn.functional.cross_entropy, Smallest())
    assert Smallest.calls == ["UnitEvidence"] and [len(v) for v in heads.values()] == [4]
    assert [len(v) for v in ffn.values()] == [32]


# --------------------------------------------------------------------------- stage capabilities and checks


class WatchConfig(StageConfig):
    type: Literal["watch"] = Field("watch", description="A third party's stage that trains under DDP and checks the model.")
    outputs: int = Field(10, ge=1, description="Outputs the model must give.")


class WatchStage(Stage[WatchConfig]):
    Config = WatchConfig
    runs_under_ddp = True

    def check_model(self, model, batch):
        out = model.eval()(batch)
        if out.shape[1] != self.config.outputs:
            raise ConfigError(self.loc("outputs"), f"the model gives {out.shape[1]} outputs", value=self.config.outputs)
        return [f"{out.shape[1]} outputs, as expected"]

    def doctor(self, state, ctx):
        return [Check("watched", "will skip", "a third party's own row", figures={"outputs": self.config.outputs})]

    def run(self, state, ctx):
        return StageResult(metrics={"watched": 1})


@pytest.fixture
def watch():
    with stages_registered(watch=WatchStage):
        yield


def test_the_ranks_follow_the_stage_class_that_declares_ddp(watch, tmp_path):
    from pruneflow import distributed
    from pruneflow.recipe import load_recipe

    stages = [{"type": "train", "epochs": 1}, {"type": "watch"}, {"type": "export", "targets": ["onnx"], "latency": None}]
    loaded = load_recipe(write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages)))
    assert [s.type for s in distributed.worker_recipe(loaded).recipe.stages] == ["train", "watch"]
    assert distributed.last_training_stage_id(loaded) == "watch"
    assert not registry.stages.get("evaluate").runs_under_ddp and registry.stages.get("qat").runs_under_ddp


def test_the_pipeline_and_doctor_ask_the_stage_for_its_checks(watch, tmp_path):
    from pruneflow.context import Reporter
    from pruneflow.doctor import run_doctor
    from pruneflow.prepare import load_inputs, plan_stages
    from pruneflow.recipe import load_recipe

    class Notes(Reporter):
        said: list[str] = []

        def info(self, message):
            self.said.append(message)

    stages = [{"type": "watch"}, {"type": "evaluate"}]
    loaded = load_recipe(write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages)))
    reporter = Notes()
    load_inputs(loaded, plan_stages(loaded), reporter)
    assert "watch: 10 outputs, as expected" in reporter.said
    report = run_doctor(loaded)
    rows = {(r.where, r.check): r for r in report.rows}
    assert rows[("watch (watch)", "watched")].status == "will skip"
    assert rows[("watch (watch)", "watched")].figures == {"outputs": 10}
    assert rows[("evaluate (evaluate)", "evaluate one batch")].status == "ok"
    wrong = load_recipe(write(tmp_path / "w.yaml", tiny_recipe_dict(stages=[{"type": "watch", "outputs": 3}])))
    with pytest.raises(PruneflowError, match="the model gives 10 outputs"):
        with wrong.locating():
            load_inputs(wrong, plan_stages(wrong), Reporter())


def test_a_stage_without_checks_of_its_own_gets_the_defaults():
    stage = Stage(StageConfig(type="x"), "x", 0)
    assert stage.doctor(None, None) == [] and stage.check_model(None, None) == []  # type: ignore[arg-type]
    assert not stage.runs_under_ddp and not stage.modifies_model and not stage.needs_train_split
