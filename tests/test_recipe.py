"""Recipe loading: positions in errors, did-you-mean, extends, --set, path resolution, schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pruneflow.errors import InputError, RecipeError, UsageError
from pruneflow.recipe import dump_recipe, json_schema, load_recipe

from conftest import REPO, tiny_recipe_dict

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

BAD = """\
name: bad
model:
  factory: digits_cnn
data:
  format: digits
stages:
  - type: train
    epochs: "three"
    lrr: 0.1
  - type: evalute
"""


def issue(exc: RecipeError, path: str):
    found = [i for i in exc.issues if i.path == path]
    assert found, f"no issue at {path}; issues: {[i.format() for i in exc.issues]}"
    return found[0]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates_and_round_trips(recipe, tmp_path):
    loaded = load_recipe(recipe)
    again = tmp_path / "resolved.yaml"
    again.write_text(dump_recipe(loaded.recipe))
    reloaded = load_recipe(again)
    assert reloaded.recipe.model_dump() == loaded.recipe.model_dump()


def test_shipped_recipes_exist():
    assert {"quickstart.yaml", "resnet20-cifar10.yaml"} <= {p.name for p in RECIPES}


def test_errors_carry_file_line_path_and_value(write_recipe):
    path = write_recipe(BAD)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    epochs = issue(err.value, "stages.0.epochs")
    assert (epochs.source, epochs.line, epochs.value) == (str(path), 8, "three")
    assert "valid integer" in epochs.message
    assert f"{path}:8  stages.0.epochs  'three'" in epochs.format()
    typo = issue(err.value, "stages.0.lrr")
    assert typo.line == 9 and "did you mean 'lr'" in typo.message
    stage_type = issue(err.value, "stages.1.type")
    assert stage_type.line == 10 and "did you mean 'evaluate'" in stage_type.message
    assert "export" in stage_type.message and "train" in stage_type.message  # the known types are listed
    assert err.value.exit_code == 2


def test_out_of_range_and_missing_key(write_recipe):
    recipe = tiny_recipe_dict()
    recipe["stages"][0]["lr"] = -1
    del recipe["model"]["factory"]
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    assert "greater than 0" in issue(err.value, "stages.0.lr").message
    missing = issue(err.value, "model.factory")
    assert missing.line is not None and "missing" in missing.message  # points at the parent `model:` line


def test_unknown_target_is_named(write_recipe):
    recipe = tiny_recipe_dict()
    recipe["stages"][2]["targets"] = ["onx"]
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    # The recipe wrote the bare name, so the issue points at the list entry itself.
    assert "did you mean 'onnx'" in issue(err.value, "stages.2.targets.0").message


def test_yaml_syntax_error_has_a_line(write_recipe):
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe("name: x\nmodel: [unclosed\n"))
    assert err.value.issues[0].line is not None
    # an unclosed `{` is the line to fix, not the next one, where PyYAML notices it (new-user trial)
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe("name: x\nstages:\n  - {type: train, epochs: 2\n  - {type: evaluate}\n"))
    assert err.value.issues[0].line == 3 and "opened on line 3: fix it there; noticed on line 4" in err.value.issues[0].message


def test_missing_and_empty_recipe_files(tmp_path, write_recipe):
    with pytest.raises(InputError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="empty"):
        load_recipe(write_recipe(""))


def test_extends_merges_mappings_replaces_lists_and_keeps_positions(tmp_path, write_recipe):
    base = tiny_recipe_dict(name="base")
    base["data"]["eval_fraction"] = 0.3
    write_recipe(base, "base/base.yaml")
    child = write_recipe(
        "extends: base/base.yaml\nname: child\ndata:\n  max_eval_samples: 50\nstages:\n  - type: evaluate\n",
        "child.yaml",
    )
    loaded = load_recipe(child)
    r = loaded.recipe
    assert r.name == "child"
    assert r.data.eval_fraction == 0.3 and r.data.max_eval_samples == 50  # deep merge
    assert [s.type for s in r.stages] == ["evaluate"]  # lists replaced
    assert [p.name for p in loaded.chain] == ["child.yaml", "base.yaml"]

    # An error in a value the parent set points into the parent file.
    base["stages"][0]["epochs"] = "three"
    write_recipe(base, "base/base.yaml")
    child.write_text("extends: base/base.yaml\nname: child\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(child)
    assert issue(err.value, "stages.0.epochs").source.endswith("base.yaml")


def test_extends_cycle_is_rejected(write_recipe):
    write_recipe("extends: b.yaml\nname: a\n", "a.yaml")
    b = write_recipe("extends: a.yaml\nname: b\n", "b.yaml")
    with pytest.raises(RecipeError) as err:
        load_recipe(b)
    assert "cycle" in str(err.value)


def test_set_overrides(write_recipe):
    path = write_recipe(tiny_recipe_dict())
    r = load_recipe(path, ["stages.0.epochs=3", "stages.0.optimizer=adamw", "data.augment.hflip=true", "seed=7"]).recipe
    assert r.stages[0].epochs == 3 and r.stages[0].optimizer == "adamw"
    assert r.data.augment.hflip is True and r.seed == 7


@pytest.mark.parametrize(
    "override, where",
    [("stages.9.epochs=3", "stages.9"), ("stages.0.epoch=3", "stages.0.epoch"), ("nope=1", "nope")],
)
def test_set_on_unknown_path_is_rejected(write_recipe, override, where):
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tiny_recipe_dict()), [override])
    found = [i for i in err.value.issues if i.path == where]
    assert found and found[0].source.startswith("--set"), [i.format() for i in err.value.issues]


def test_set_without_equals_is_a_usage_error(write_recipe):
    with pytest.raises(UsageError):
        load_recipe(write_recipe(tiny_recipe_dict()), ["stages.0.epochs"])


def test_paths_resolve_relative_to_the_file_that_set_them(tmp_path, write_recipe, monkeypatch):
    recipe = tiny_recipe_dict()
    recipe["model"]["checkpoint"] = "weights/model.pt"
    write_recipe(recipe, "sub/base.yaml")
    child = write_recipe("extends: sub/base.yaml\n", "child.yaml")
    r = load_recipe(child).recipe
    assert Path(r.model.checkpoint) == (tmp_path / "sub" / "weights" / "model.pt").resolve()
    monkeypatch.chdir(tmp_path / "sub")
    r = load_recipe(child, ["model.checkpoint=other.pt"]).recipe
    assert Path(r.model.checkpoint) == (tmp_path / "sub" / "other.pt").resolve()


def test_resolved_yaml_spells_out_defaults(write_recipe):
    text = dump_recipe(load_recipe(write_recipe(tiny_recipe_dict())).recipe)
    data = yaml.safe_load(text)
    assert data["stages"][0]["schedule"] == "cosine" and "extends" not in data


def test_schema_has_a_description_on_every_field():
    schema = json_schema()
    missing = []

    def walk(node, where):
        if isinstance(node, dict):
            for name, prop in (node.get("properties") or {}).items():
                if "description" not in prop:
                    missing.append(f"{where}.{name}")
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    walk(schema, "$")
    assert not missing, missing
    text = str(schema)
    assert all(name in text for name in ("train", "evaluate", "export", "onnx"))


def test_recipe_reference_doc_is_current():
    from pruneflow.recipe.reference import render

    committed = (REPO / "docs" / "recipe-reference.md").read_text()
    assert committed == render(), "regenerate: python -m pruneflow.recipe.reference > docs/recipe-reference.md"


def test_a_target_listed_twice_is_rejected(write_recipe):
    recipe = tiny_recipe_dict()
    recipe["stages"][2]["targets"] = ["onnx", {"type": "onnx", "opset": 18}]
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    assert "listed twice" in issue(err.value, "stages.2.targets").message
