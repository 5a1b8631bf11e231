"""Hostile and broken recipe files through the real CLI (issue 14): every one exits 2 with the file, the
line or key and the fix, writes nothing, and never echoes what a file reached through `extends` holds.

Each case builds its files in tmp_path and returns (arguments, texts the error must show, texts it must
not show); it runs under `validate`, `optimize` and `optimize --dry-run`. A planted secret lives outside
the recipe's folder (``secrets/credentials.yaml``) or inside it (``.env``).
"""

from __future__ import annotations

import json
import os
import tracemalloc
from importlib import resources
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pruneflow.cli import app
from conftest import tiny_recipe_dict
from pruneflow.errors import RecipeError, UsageError
from pruneflow.recipe import load_recipe
from pruneflow.recipe.safe_yaml import MAX_BYTES, MAX_DEPTH, MAX_NODES

runner = CliRunner(env={"FORCE_COLOR": None, "COLUMNS": "200"})

SECRET_KEY, SECRET_VALUE = "aws_secret_access_key", "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
TOKEN = "ghp_tok3nS3cr3tV4lu3"

BOMB = """\
name: bomb
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""

DUPLICATE = """\
name: tiny
model:
  factory: digits_cnn
data:
  format: digits
stages:
  - type: train
    epochs: 1
    batch_size: 32
    epochs: 50
  - type: evaluate
"""


def write(path: Path, content: str | bytes | dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def tiny_text(**changes) -> str:
    return yaml.safe_dump(tiny_recipe_dict(**changes), sort_keys=False)


def plant_secrets(tmp_path: Path) -> Path:
    """A credentials file outside the project folder, and a .env inside it."""
    write(tmp_path / "secrets" / "credentials.yaml", f"aws_access_key_id: AKIAFAKE0000\n{SECRET_KEY}: {SECRET_VALUE}\n")
    write(tmp_path / "proj" / ".env", f"GITHUB_TOKEN={TOKEN}\n")
    return tmp_path / "proj"


def invoke(*args: object):
    result = runner.invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


# --------------------------------------------------------------------------- extends confinement


def _extends_outside(tmp_path):
    proj = plant_secrets(tmp_path)
    r = write(proj / "r.yaml", "name: x\nextends: ../secrets/credentials.yaml\n")
    return [r], [f"{r}:2", "extends", "outside", str(proj), "--allow-path"], [SECRET_VALUE, SECRET_KEY, "AKIAFAKE"]


def _extends_system_file(tmp_path):
    proj = plant_secrets(tmp_path)
    r = write(proj / "r.yaml", "extends: /etc/passwd\nname: x\n")
    return [r], [f"{r}:1", "/etc/passwd is outside", "Fix:"], ["root:", "/bin/"]


def _extends_symlink_out(tmp_path):
    proj = plant_secrets(tmp_path)
    (proj / "base.yaml").symlink_to(tmp_path / "secrets" / "credentials.yaml")
    r = write(proj / "r.yaml", "extends: base.yaml\nname: x\n")
    return [r], [f"{r}:1", "credentials.yaml is outside", "--allow-path"], [SECRET_VALUE, SECRET_KEY]


def _extends_dotdot_escape(tmp_path):
    proj = plant_secrets(tmp_path)
    write(proj / "sub" / "keep.yaml", "name: keep\n")
    r = write(proj / "r.yaml", "extends: sub/../../secrets/credentials.yaml\nname: x\n")
    return [r], [f"{r}:1", "outside"], [SECRET_VALUE, SECRET_KEY]


def _allowed_secret_file_never_echoed(tmp_path):
    """--allow-path lets `extends` read it; it is no recipe, and what it holds is never shown."""
    proj = plant_secrets(tmp_path)
    r = write(proj / "r.yaml", "name: x\nextends: ../secrets/credentials.yaml\n")
    creds = (tmp_path / "secrets" / "credentials.yaml").resolve()
    return ([r, "--allow-path", tmp_path / "secrets"],
            [f"{creds}:1  <key>  unknown key (its name is not shown", f"{creds}:2  <key>", "Known keys:", f"{r}:1  model"],
            [SECRET_VALUE, SECRET_KEY, "AKIAFAKE", "aws_access_key_id"])


def _env_file_in_the_folder(tmp_path):
    proj = plant_secrets(tmp_path)
    r = write(proj / "r.yaml", "name: x\nextends: .env\n")
    return [r], [f"{(proj / '.env').resolve()}:1", "must hold a mapping", "Fix:"], [TOKEN, "GITHUB_TOKEN"]


def _extended_recipe_with_bad_values(tmp_path):
    """A base recipe that fails validation: file and line of each problem, no value, no guess from it."""
    proj = plant_secrets(tmp_path)
    base = tiny_recipe_dict()
    base["stages"][0]["optimizer"] = TOKEN
    base["stages"][1]["type"] = "evalute"
    base["data"]["format"] = "csvv"
    write(proj / "base.yaml", base)
    r = write(proj / "r.yaml", "extends: base.yaml\nname: x\n")
    lines = (proj / "base.yaml").read_text().splitlines()
    line = next(i for i, ln in enumerate(lines, 1) if "evalute" in ln)
    return ([r], [f"{(proj / 'base.yaml').resolve()}:{line}  stages.1.type  unknown stage type. Known:", "stages.0.optimizer",
                  "data.format", "not shown"],
            [TOKEN, "evalute", "did you mean", "csvv"])


def _extended_file_with_broken_yaml(tmp_path):
    proj = plant_secrets(tmp_path)
    write(proj / "base.yaml", f'name: base\npassword: "{TOKEN}\n')
    r = write(proj / "r.yaml", "extends: base.yaml\nname: x\n")
    # the line the unclosed quote opens on (PyYAML notices it at the end, line 3)
    return [r], [f"{(proj / 'base.yaml').resolve()}:2", "is not valid YAML", "Fix:"], [TOKEN]


def _extended_file_extends_outside(tmp_path):
    """The second step of a chain: the extended file is named by file and line, the path it wrote is not shown."""
    proj = plant_secrets(tmp_path)
    write(proj / "base.yaml", "name: base\nextends: ../secrets/credentials.yaml\n")
    r = write(proj / "r.yaml", "extends: base.yaml\nname: x\n")
    return [r], [f"{(proj / 'base.yaml').resolve()}:2  extends  the file it names is outside"], [
        "secrets", SECRET_VALUE, SECRET_KEY]


def _extends_a_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    r = write(tmp_path / "r.yaml", "extends: sub\nname: x\n")
    return [r], [f"{r}:1", "is not a file"], []


def _extends_unusable_paths(tmp_path):
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    r = write(tmp_path / "r.yaml", "extends: loop.yaml\nname: x\n")
    return [r], [f"{r}:1", "not a usable path", "symlink loop"], []


def _extends_a_long_name(tmp_path):
    r = write(tmp_path / "r.yaml", f"extends: {'a' * 5000}.yaml\nname: x\n")
    return [r], [f"{r}:1", "does not exist"], []


def _extends_not_a_path(tmp_path):
    r = write(tmp_path / "r.yaml", "name: x\nextends: [base.yaml]\n")
    return [r], [f"{r}:2", "`extends` must be a path", "extends: base.yaml"], []


def _allow_path_not_a_folder(tmp_path):
    r = write(tmp_path / "r.yaml", tiny_text())
    return [r, "--allow-path", tmp_path / "nope"], ["usage error", "--allow-path", "is not a folder", "Fix:"], []


# --------------------------------------------------------------------------- YAML that costs or lies


def _alias_bomb(tmp_path):
    r = write(tmp_path / "r.yaml", BOMB)
    return [r], [f"{r}:6", "aliases expand to too many values", f"more than {MAX_NODES:,} values", "Fix:"], []


def _self_referencing_alias(tmp_path):
    r = write(tmp_path / "r.yaml", "name: x\nmodel: &m\n  factory: digits_cnn\n  kwargs: *m\n")
    return [r], [f"{r}:4", "model.kwargs", "refers to the collection that contains it", "Fix:"], []


def _deep_nesting(tmp_path):
    r = write(tmp_path / "r.yaml", "name: x\nmodel:\n  kwargs: " + "[" * 5000 + "]" * 5000 + "\n")
    return [r], [f"{r}:3", "nested too deeply", f"more than {MAX_DEPTH} levels", "model.kwargs.0"], []


def _deep_nesting_through_aliases(tmp_path):
    nested = "[" * 40 + "1" + "]" * 40
    r = write(tmp_path / "r.yaml", f"name: x\na: &a {nested}\nb: &b {'[' * 30}*a{']' * 30}\n")
    return [r], [f"{r}:3", "nested too deeply", "aliases included"], []


def _duplicate_key(tmp_path):
    r = write(tmp_path / "r.yaml", DUPLICATE)
    return [r], [f"{r}:10", "stages.0.epochs", "set at line 8 and again at line 10", "Fix: delete one"], []


def _duplicate_top_level_key(tmp_path):
    r = write(tmp_path / "r.yaml", tiny_text() + "name: other\n")
    return [r], [f"{r}:", "  name  the key is set at line 1 and again at line"], []


def _python_tag(tmp_path):
    marker = tmp_path / "PWNED"
    r = write(tmp_path / "r.yaml", f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    return [r], [f"{r}:1", "a YAML tag", "python/object/apply", "never builds Python objects"], []


def _binary_tag(tmp_path):
    r = write(tmp_path / "r.yaml", tiny_text(description="x").replace("description: x", "description: !!binary aGVsbG8="))
    return [r], [f"{r}:", "a YAML tag", "binary"], []


def _number_key(tmp_path):
    r = write(tmp_path / "r.yaml", tiny_text() + "1: one\n")
    return [r], [f"{r}:", "a key that YAML reads as a number", "quote the key"], []


def _boolean_key(tmp_path):
    r = write(tmp_path / "r.yaml", "name: x\nmodel:\n  factory: digits_cnn\n  kwargs:\n    on: 1\n")
    return [r], [f"{r}:5", "model.kwargs", "reads as a boolean", "'on'"], []


def _mapping_key(tmp_path):
    r = write(tmp_path / "r.yaml", "name: x\n? [a, b]\n: 1\n")
    return [r], [f"{r}:2", "a key that YAML reads as a list or mapping"], []


def _not_utf8(tmp_path):
    r = write(tmp_path / "r.yaml", "name: x\ndescription: caf\xe9\n".encode("latin-1"))
    return [r], [f"{r}:2", "not UTF-8", "save the recipe as UTF-8"], []


def _utf16(tmp_path):
    r = write(tmp_path / "r.yaml", tiny_text().encode("utf-16"))
    return [r], [f"{r}:1", "UTF-16", "save the recipe as UTF-8"], []


def _binary_file(tmp_path):
    r = write(tmp_path / "model.pt", b"PK\x03\x04" + bytes(range(256)) * 4)
    return [r], [f"{r}:1", "a binary file, not a YAML recipe", "Fix:"], []


def _huge_file(tmp_path):
    r = write(tmp_path / "r.yaml", tiny_text() + "# " + "x" * MAX_BYTES + "\n")
    return [r], [str(r), "too large for a recipe", f"larger than {MAX_BYTES:,} bytes", "Fix:"], []


def _control_character(tmp_path):
    r = write(tmp_path / "r.yaml", "name: x\ndescription: bell\x07\n")
    return [r], [f"{r}:2", "control character (#x0007)"], []


def _top_level_list(tmp_path):
    r = write(tmp_path / "r.yaml", "- name: x\n- name: y\n")
    return [r], [f"{r}:1", "must hold a mapping", "not a list", "Fix:"], []


def _top_level_number(tmp_path):
    r = write(tmp_path / "r.yaml", "42\n")
    return [r], [f"{r}:1", "must hold a mapping", "not a number"], []


def _two_documents(tmp_path):
    r = write(tmp_path / "r.yaml", tiny_text() + "---\nname: second\n")
    return [r], [f"{r}:", "is not valid YAML", "but found another document"], []


def _a_folder(tmp_path):
    (tmp_path / "recipes").mkdir()
    return [tmp_path / "recipes"], [str(tmp_path / "recipes"), "is a folder, not a recipe file", "Fix:"], []


# --------------------------------------------------------------------------- --set


def _set(tmp_path, item):
    return [write(tmp_path / "r.yaml", tiny_text()), "--set", item]


def _set_extends(tmp_path):
    return _set(tmp_path, "extends=/etc/passwd"), ["usage error", "--set 'extends=/etc/passwd'", "Fix:"], ["root:"]


def _set_python_tag(tmp_path):
    return _set(tmp_path, "name=!!python/object/apply:os.system [ls]"), ["usage error", "a YAML tag", "Fix:"], []


def _set_self_alias(tmp_path):
    return _set(tmp_path, "model.kwargs=&a {x: *a}"), ["usage error", "an alias inside the collection it names"], []


def _set_unicode_digit(tmp_path):
    return _set(tmp_path, "stages.²=1"), ["--set 'stages.²=1'", "'stages' is a list of 3 entries", "use an index 0..2"], []


def _set_negative_index(tmp_path):
    return _set(tmp_path, "stages.-1.epochs=2"), ["'stages' is a list of 3 entries"], []


def _set_deep_path(tmp_path):
    return _set(tmp_path, ".".join(["a"] * 200) + "=1"), ["usage error", "a key path of 200 parts"], []


def _set_empty_part(tmp_path):
    return _set(tmp_path, "stages..epochs=1"), ["usage error", "empty key path"], []


def _set_unparsable_value_into_an_int(tmp_path):
    return _set(tmp_path, "stages.0.epochs=[1"), ["--set stages.0.epochs=[1  stages.0.epochs  '[1'", "valid integer"], []


CASES = [
    _extends_outside, _extends_system_file, _extends_symlink_out, _extends_dotdot_escape, _allowed_secret_file_never_echoed,
    _env_file_in_the_folder, _extended_recipe_with_bad_values, _extended_file_with_broken_yaml, _extended_file_extends_outside,
    _extends_a_folder,
    _extends_unusable_paths, _extends_a_long_name, _extends_not_a_path, _allow_path_not_a_folder,
    _alias_bomb, _self_referencing_alias, _deep_nesting, _deep_nesting_through_aliases, _duplicate_key,
    _duplicate_top_level_key, _python_tag, _binary_tag, _number_key, _boolean_key, _mapping_key, _not_utf8, _utf16,
    _binary_file, _huge_file, _control_character, _top_level_list, _top_level_number, _two_documents, _a_folder,
    _set_extends, _set_python_tag, _set_self_alias, _set_unicode_digit, _set_negative_index, _set_deep_path,
    _set_empty_part, _set_unparsable_value_into_an_int,
]
COMMANDS = {"validate": [], "optimize": ["--json"], "dry-run": ["--dry-run"]}


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("command", COMMANDS)
def test_hostile_recipe_exits_2_and_writes_nothing(tmp_path, monkeypatch, case, command):
    monkeypatch.chdir(tmp_path)
    args, expected, forbidden = case(tmp_path)
    before = snapshot(tmp_path)
    out = tmp_path / "runs"
    extra = ["--out", out, *COMMANDS[command]] if command != "validate" else []
    result = invoke("validate" if command == "validate" else "optimize", *args, *extra)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    for text in expected:
        assert text in result.stderr, (text, result.stderr)
    assert "Fix: " in result.stderr, result.stderr  # every refusal says how to fix it
    for text in forbidden:
        assert text not in result.stdout and text not in result.stderr, (text, result.output)
    if command == "optimize":  # --json: one object, the same exit code, the issues located
        payload = json.loads(result.stdout)
        assert payload["exit_code"] == 2 and payload["error"]["hint"], payload
    assert not out.exists() and snapshot(tmp_path) == before
    assert not (tmp_path / "PWNED").exists()


# --------------------------------------------------------------------------- bounds, measured


def test_alias_bomb_stays_within_memory(tmp_path):
    path = write(tmp_path / "bomb.yaml", BOMB)
    tracemalloc.start()
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert err.value.issues[0].line == 6
    # The bound that cannot flake: memory (the full expansion is 10**9 strings). How long the refusal takes is
    # benchmarks/timings.py's figure, not an assert on a shared machine.
    assert peak < 20 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_a_recipe_at_the_node_budget_still_loads_and_one_more_value_does_not(tmp_path):
    """The bound is exact: MAX_NODES values load (a long list in model.kwargs), MAX_NODES + 1 do not."""
    def recipe_with(values: int) -> Path:
        data = tiny_recipe_dict()
        data["model"]["kwargs"] = {"items": []}
        data["model"]["kwargs"]["items"] = list(range(values - _node_count(data)))
        assert _node_count(data) == values
        return write(tmp_path / f"r{values}.yaml", data)

    assert len(load_recipe(recipe_with(MAX_NODES)).recipe.model.kwargs["items"]) > MAX_NODES - 100
    with pytest.raises(RecipeError, match="too many values"):
        load_recipe(recipe_with(MAX_NODES + 1))


def _node_count(data) -> int:
    """Values the composer counts: every scalar, key, list and mapping."""
    if isinstance(data, dict):
        return 1 + sum(1 + _node_count(v) for v in data.values())
    if isinstance(data, list):
        return 1 + sum(_node_count(v) for v in data)
    return 1


def test_depth_bound_is_exact(tmp_path):
    def nested(levels: int) -> Path:  # the root, model and kwargs mappings, then levels - 3 lists
        inner = "[" * (levels - 3) + "1" + "]" * (levels - 3)
        return write(tmp_path / f"d{levels}.yaml", tiny_text().replace("kwargs:\n", f"kwargs:\n    x: {inner}\n"))

    assert load_recipe(nested(MAX_DEPTH)).recipe.model.kwargs["x"]
    with pytest.raises(RecipeError, match="nested too deeply"):
        load_recipe(nested(MAX_DEPTH + 1))


# --------------------------------------------------------------------------- what still works

ANCHORED = """\
name: tiny
model: {factory: digits_cnn, kwargs: {width: 8}}
data: {format: digits, max_train_samples: 300, max_eval_samples: 100}
stages:
  - &train {type: train, epochs: 1, batch_size: 32, lr: 0.05}
  - <<: *train
    name: again
    epochs: 2
  - type: evaluate
gates:
  - &gate {metric: evaluate.accuracy, min: 0.0}
  - *gate
"""


def test_aliases_and_merge_keys_within_the_budget_still_work(tmp_path):
    recipe = load_recipe(write(tmp_path / "r.yaml", ANCHORED)).recipe
    again = recipe.stages[1]
    assert (again.name, again.epochs, again.batch_size, again.lr) == ("again", 2, 32, 0.05)
    assert [g.min for g in recipe.gates] == [0.0, 0.0]


def test_set_into_an_aliased_value_changes_only_that_place(tmp_path):
    """An alias repeats a value; a --set at one place changes that place only, as the command reads."""
    recipe = load_recipe(write(tmp_path / "r.yaml", ANCHORED), ["gates.0.min=0.5", "stages.0.epochs=7"]).recipe
    assert [g.min for g in recipe.gates] == [0.5, 0.0]
    assert [s.epochs for s in recipe.stages[:2]] == [7, 2]


def test_allow_path_and_the_shipped_templates_let_extends_read_outside(tmp_path):
    write(tmp_path / "shared" / "base.yaml", tiny_recipe_dict(name="base"))
    r = write(tmp_path / "proj" / "r.yaml", "extends: ../shared/base.yaml\nname: mine\n")
    with pytest.raises(RecipeError, match="outside"):
        load_recipe(r)
    assert load_recipe(r, allow_paths=[tmp_path / "shared"]).recipe.name == "mine"
    result = invoke("validate", r, "--allow-path", tmp_path / "shared")
    assert result.exit_code == 0 and "valid" in result.stdout, result.output

    templates = Path(str(resources.files("pruneflow.templates")))
    quick = write(tmp_path / "proj" / "q.yaml", f"extends: {templates / 'quickstart.yaml'}\nname: q\n")
    assert load_recipe(quick).recipe.name == "q"


def test_duplicate_keys_name_both_lines_in_process(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path / "r.yaml", DUPLICATE))
    issue = err.value.issues[0]
    assert (issue.line, issue.path) == (10, "stages.0.epochs") and "line 8" in issue.message


def test_set_value_refusals_are_usage_errors(tmp_path):
    path = write(tmp_path / "r.yaml", tiny_text())
    bomb_value = "[" + ", ".join(["&a [1,2,3,4,5,6,7,8,9,10]"] + ["*a"] * 3000) + "]"
    with pytest.raises(UsageError, match="too many values"):
        load_recipe(path, [f"model.kwargs.x={bomb_value}"])
    assert load_recipe(path, ["model.kwargs.when=2024-01-01"]).recipe.model.kwargs["when"] == "2024-01-01"


@pytest.mark.skipif(os.name != "posix", reason="symlinks")
def test_allow_path_does_not_let_a_symlink_escape_it(tmp_path):
    plant_secrets(tmp_path)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "base.yaml").symlink_to(tmp_path / "secrets" / "credentials.yaml")
    r = write(tmp_path / "proj" / "r.yaml", "extends: ../allowed/base.yaml\nname: x\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(r, allow_paths=[allowed])
    assert "outside" in str(err.value) and SECRET_VALUE not in str(err.value)
