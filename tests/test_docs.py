"""docs/recipes.md documents exactly the recipe keys the code has, each with its default and allowed values."""

import dataclasses
import re
import typing
from pathlib import Path

import yaml

from qwen_mtp.recipe import Recipe

DOC = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
ROW = re.compile(r"^\| (`[^|]+`) \| ([^|]*) \| (.*) \|$")  # | `section.key` [/ `section.key2`] | default | meaning |


def documented() -> dict[str, tuple[str, str]]:
    """key -> (default cell, meaning cell); a row may document two keys as `a` / `b` with defaults x / y."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if not match:
            continue
        keys = [key.strip().strip("`") for key in match[1].split(" / ")]
        defaults = match[2].split(" / ") if len(keys) > 1 and " / " in match[2] else [match[2]] * len(keys)
        assert len(defaults) == len(keys), line
        rows.update({key: (default.strip(), match[3]) for key, default in zip(keys, defaults, strict=True)})
    return rows


def code_keys() -> dict[str, tuple[object, object]]:
    """key -> (default, type hint) for every field of every Recipe section."""
    keys = {}
    for section in dataclasses.fields(Recipe):
        cls = typing.get_type_hints(Recipe)[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            keys[f"{section.name}.{f.name}"] = (default, hints[f.name])
    return keys


def allowed_values(hint) -> tuple:
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return tuple(v for arm in typing.get_args(hint) for v in allowed_values(arm))


def test_every_recipe_key_is_documented_and_no_other():
    doc, code = documented(), code_keys()
    assert sorted(set(code) - set(doc)) == [], "keys missing from docs/recipes.md"
    assert sorted(set(doc) - set(code)) == [], "docs/recipes.md documents keys the code does not have"


def test_documented_defaults_are_the_code_defaults():
    doc = documented()
    wrong = {key: (doc[key][0], default) for key, (default, _) in code_keys().items() if key in doc}
    wrong = {key: pair for key, pair in wrong.items() if yaml.safe_load(pair[0]) != pair[1]}
    assert wrong == {}, "docs/recipes.md default (as YAML) != the dataclass default"


def test_documented_meanings_list_every_allowed_value():
    doc = documented()
    missing = {
        key: [v for v in allowed_values(hint) if not re.search(rf"(?<![\w-]){re.escape(v)}(?![\w-])", doc[key][1])]
        for key, (_, hint) in code_keys().items()
        if allowed_values(hint)
    }
    assert {key: values for key, values in missing.items() if values} == {}
