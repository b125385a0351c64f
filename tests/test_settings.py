"""segkv/settings.py declares every environment variable segkv reads; nothing else reads the environment."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from segkv import settings
from segkv.settings import Settings, declared, load_settings

PACKAGE = Path(__file__).resolve().parent.parent / "segkv"
DOCS = PACKAGE.parent / "docs" / "configuration.md"
ENV_ACCESS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _sources():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "settings.py"]


def test_only_the_settings_module_reads_the_environment():
    errors = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in ENV_ACCESS
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                errors.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: os.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                errors += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from os import {a.name}"
                           for a in node.names if a.name in ENV_ACCESS]
    assert not errors, "read the environment through segkv.settings:\n" + "\n".join(errors)


def test_every_variable_named_in_the_package_is_declared():
    names = set(declared())
    missing = []
    for path in _sources():
        for match in re.finditer(r"\bSEGKV_[A-Z0-9_]+", path.read_text()):
            name = match.group()
            if name.endswith("_"):  # a family, ``SEGKV_TRITON_*``
                ok = any(n.startswith(name) for n in names)
            else:
                ok = name in names
            if not ok:
                missing.append(f"{path.relative_to(PACKAGE.parent)}: {name}")
    assert not missing, "declare these in segkv/settings.py:\n" + "\n".join(missing)


def test_every_declared_setting_is_used():
    text = "\n".join(p.read_text() for p in _sources())
    unused = [f.name for f in dataclasses.fields(Settings) if not re.search(rf"\.{f.name}\b", text)]
    assert not unused, f"settings nothing reads: {unused}"


def test_the_documented_variables_are_the_declared_ones():
    section = DOCS.read_text().split("## Environment overrides", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            documented |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    assert documented == set(declared()), (
        f"undocumented: {sorted(set(declared()) - documented)}; "
        f"not declared: {sorted(documented - set(declared()))}")


def test_defaults_and_parsing():
    assert load_settings({}) == Settings()
    s = load_settings({"SEGKV_CUDA_BLOCKS_PER_SM": " 3 ", "SEGKV_CUDA_MIN_PARTITION_ROWS": "",
                       "TRITON_INTERPRET": "1", "SEGKV_API_KEY": "", "SEGKV_LOOKAHEAD": "2"})
    assert (s.cuda_blocks_per_sm, s.cuda_min_partition_rows) == (3, None)  # blanks stripped; empty: default
    assert (s.triton_interpret, s.api_key, s.lookahead) == (True, "", 2)
    assert not load_settings({"TRITON_INTERPRET": ""}).triton_interpret  # exact-one: on only for "1"
    assert not load_settings({"TRITON_INTERPRET": "2"}).triton_interpret
    assert not Settings().triton_interpret and Settings().home is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.lookahead = 2


@pytest.mark.parametrize("name,value", [("SEGKV_LOOKAHEAD", "four"), ("SEGKV_CUDA_BLOCKS_PER_SM", "yes"),
                                        ("SEGKV_CUDA_MIN_LATENT_PARTITION_ROWS", "1.5")])
def test_a_bad_value_names_its_variable(name, value):
    with pytest.raises(ValueError, match=f"{name} must be an integer, got '{value}'"):
        load_settings({name: value})


def test_at_most_fifteen_settings():
    """Only settings both of whose sides serve users: the rest are constants of the code."""
    assert len(declared()) <= 15, sorted(declared())


def test_settings_are_read_once_at_import():
    assert isinstance(settings.SETTINGS, Settings)
    assert all(kind in (settings.INTEGER, settings.EXACT_ONE, settings.TEXT)
               and help for kind, _, help in declared().values())
