"""benchmarks/ and scripts/ use the project's public names only: no file there imports an
underscore name of another first-party module (``segkv``, ``benchmarks`` or a script beside it)
or reaches one through an attribute (``module._name``, ``obj._attr``). Dunder names are fine, and
so are a file's own private names (those it defines, and attributes it sets on ``self``/``cls``).
A private name that a benchmark or script still needs is made public in its own module.

The rule is about the project's API: attributes of third-party modules (``torch._dynamo.config``)
are skipped, and ``obj._attr`` on an object of unknown type counts where ``_attr`` is a private name
the project defines (``runner.graphs._buckets``), not a third-party object's (``_compiled_call``)."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("benchmarks", "scripts")
FIRST_PARTY = {"segkv", "benchmarks", "tools"}  # plus the modules of scripts/ (imported by bare name there)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _first_party(module: str | None, level: int, local: set[str]) -> bool:
    if level:  # a relative import stays inside the project
        return True
    root = (module or "").split(".")[0]
    return root in FIRST_PARTY or root in local


def _own_names(tree: ast.AST) -> set[str]:
    """The names a file defines itself: functions, classes, bound names, arguments, and the
    attributes it assigns on ``self`` or ``cls``."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            own.add(node.attr)
    return own


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def private_uses(source: str, *, local: frozenset[str] = frozenset(),
                  project: frozenset[str] | None = None) -> list[tuple[int, str]]:
    """``(line, name)`` of every underscore name of another first-party module that ``source``
    imports or reaches by attribute. ``local``: the bare module names importable beside it
    (the other scripts of scripts/). ``project``: the private names the project defines, which an
    attribute of an object of unknown type is checked against (None: every private name counts)."""
    tree = ast.parse(source)
    local = set(local)
    own = _own_names(tree)
    third_party: set[str] = set()  # names bound to third-party modules or their members
    modules: set[str] = set()  # names bound to first-party modules or their members
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _first_party(alias.name, 0, local):
                    found += [(node.lineno, part) for part in alias.name.split(".") if _private(part)]
                    modules.add(alias.asname or alias.name.split(".")[0])
                else:
                    third_party.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if _first_party(node.module, node.level, local):
                found += [(node.lineno, part) for part in (node.module or "").split(".") if _private(part)]
                found += [(node.lineno, alias.name) for alias in node.names if _private(alias.name)]
                modules.update(alias.asname or alias.name for alias in node.names)
            else:
                third_party.update(alias.asname or alias.name for alias in node.names)

    def reaches(base: ast.expr, name: str) -> bool:
        if not _private(name) or name in own:
            return False
        root = _root(base)
        if isinstance(root, ast.Name):
            if root.id in ("self", "cls") or root.id in third_party:
                return False
            if root.id in modules:
                return True
        return project is None or name in project

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if reaches(node.value, node.attr):
                found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            if reaches(node.args[0], node.args[1].value):
                found.append((node.lineno, node.args[1].value))
    return sorted(set(found))


def _files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))


def _local_modules() -> frozenset[str]:
    return frozenset(p.stem for p in (REPO / "scripts").glob("*.py"))


@functools.cache
def _project_private() -> frozenset[str]:
    """Every private name a first-party file defines (segkv/, benchmarks/, scripts/)."""
    names: set[str] = set()
    for folder in ("segkv", *FOLDERS):
        for path in (REPO / folder).rglob("*.py"):
            names.update(n for n in _own_names(ast.parse(path.read_text(encoding="utf-8"))) if _private(n))
    return frozenset(names)


def _uses(path: Path) -> list[tuple[int, str]]:
    local = _local_modules() if path.parent.name == "scripts" else frozenset()
    return private_uses(path.read_text(encoding="utf-8"), local=local, project=_project_private())


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(REPO)))
def test_public_names_only(path: Path):
    rel = str(path.relative_to(REPO))
    bad = [f"{rel}:{line}: {name}" for line, name in _uses(path)]
    assert not bad, "underscore names of other modules (make them public in their own module):\n" + "\n".join(bad)


# -- the checker itself: what it must reject and what it must let through ------------------------
@pytest.mark.parametrize("source, name", [
    ("from segkv.models.loader import _keep_fp32\n", "_keep_fp32"),
    ("from benchmarks.decode_e2e import build_segkv, _decode\n", "_decode"),
    ("from benchmarks.decode_attention import (\n    Timer,\n    _fill_random,\n)\n", "_fill_random"),
    ("from segkv.kernels._private import thing\n", "_private"),
    ("import segkv._impl\n", "_impl"),
    ("from segkv.kernels import paged_attention\npaged_attention._stage1_kernel\n", "_stage1_kernel"),
    ("import segkv.models.loader as loader\nloader._keep_fp32('x')\n", "_keep_fp32"),
    ("def f(runner):\n    return runner.graphs._buckets\n", "_buckets"),
    ("def f(runner):\n    return getattr(runner.graphs, '_buckets')\n", "_buckets"),
    ("from . import helpers\nhelpers._inner()\n", "_inner"),
])
def test_checker_rejects(source: str, name: str):
    assert name in {n for _, n in private_uses(source)}


def test_checker_rejects_a_sibling_script():
    source = "from expert_gemv_sweep import _time\n"
    assert private_uses(source) == []  # a third-party module as far as it knows
    assert private_uses(source, local=frozenset({"expert_gemv_sweep"})) == [(1, "_time")]


def test_checker_skips_third_party_objects_given_the_project_names():
    source = "def f(hf, runner):\n    return hasattr(hf, '_compiled_call'), runner.graphs._buckets\n"
    assert private_uses(source, project=frozenset({"_buckets"})) == [(2, "_buckets")]


@pytest.mark.parametrize("source", [
    "from segkv.models.loader import keep_fp32\n",
    "class A:\n    def __init__(self):\n        self._x = 1\n    def f(self):\n        return self._x\n",
    "def _helper():\n    pass\n_helper()\n",
    "class T:\n    def _sized(self):\n        return self\n    @classmethod\n    def make(cls):\n        return cls()._sized()\n",
    "import torch\ntorch._dynamo.config\n",
    "from torch._inductor.cudagraph_trees import reset_cudagraph_trees\n",
    "def f(m):\n    return m.__dict__, type(m).__name__\n",
    "_OWN = 1\n",
])
def test_checker_accepts(source: str):
    assert private_uses(source) == []
