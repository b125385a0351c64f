"""ARCHITECTURE.md's layout rules: imports go downward only; kernels and cache stay narrow."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "segkv"
VALUE_MODULES = {"config", "sampling_params", "outputs"}
# Rank of each part: a module may import parts of lower rank (and its own part).
RANK = {
    "settings": -1,  # segkv/settings.py, the environment's variables: the lowest layer
    "value": 0,
    "kernels": 1,
    "cache": 1,
    "attention": 2,
    "distributed": 2,  # the tensor-parallel group and its collectives (torch.distributed only)
    "layers": 3,
    "models": 4,
    "runner": 5,
    "scheduler": 5,
    "tokenizer": 5,  # text <-> token ids; the engine and the server's templates use it
    "sessions": 6,  # conversations and sessions take their engine through a Protocol
    "spec": 6,  # speculative decoding: proposers and the verification of their drafts
    "structured": 6,  # constrained decoding: grammars compiled for a tokenizer, a matcher per sequence
    "engine": 7,
    "server": 8,
    "bench": 9,
    "cli": 10,  # the command wires everything, benchmarks included
    "root": 9,
}


def _part(module: str) -> str:
    """``segkv.attention.plan`` -> ``attention``; ``segkv.config`` -> ``value``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    name = parts[1]
    if name in VALUE_MODULES:
        return "value"
    if name == "cli":
        return "cli"
    return name


def _segkv_imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "segkv"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: use absolute imports")
            if node.module and node.module.split(".")[0] == "segkv":
                found.append((node.module, node.lineno))
    return found


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield path, ".".join(parts)


def test_every_part_is_known():
    for _, module in _modules():
        assert _part(module) in RANK, f"{module} is in no part of ARCHITECTURE.md's layout"


def test_imports_go_downward_only():
    errors = []
    for path, module in _modules():
        mine = _part(module)
        for target, line in _segkv_imports(path):
            theirs = _part(target)
            if theirs == mine:
                continue
            if RANK[theirs] >= RANK[mine]:
                errors.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {mine} imports {target}")
    assert not errors, "imports that go upward or sideways:\n" + "\n".join(errors)


def test_kernels_import_nothing_from_segkv():
    for path, module in _modules():
        if _part(module) == "kernels":  # kernels share helpers among themselves, nothing else
            outside = [name for name, _ in _segkv_imports(path)
                       if not name.startswith("segkv.kernels") and name != "segkv.settings"]
            assert not outside, f"{path}: kernels import only torch, triton, other kernels and settings"


def test_cache_bookkeeping_is_pure_python():
    """Only the owners of tensors import torch inside cache/: storage.py (the pages), tiers.py
    (their host and disk copies) and files.py (the files those are written to)."""
    owners = {"storage.py", "tiers.py", "files.py"}
    for path in (PACKAGE / "cache").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if path.name not in owners:
            assert "torch" not in names, f"{path.name} imports torch; only {sorted(owners)} may"


def test_value_objects_and_scheduler_never_touch_cuda():
    for path, module in _modules():
        if _part(module) in ("value", "scheduler"):
            assert "torch.cuda" not in path.read_text(), f"{path}: no torch.cuda here"


def test_rule_checker_sees_an_upward_import(tmp_path):
    """The checker itself works: an upward import is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from segkv.engine import LLM\nimport segkv.server.app\n")
    assert [t for t, _ in _segkv_imports(bad)] == ["segkv.engine", "segkv.server.app"]
    assert RANK[_part("segkv.engine")] > RANK[_part("segkv.layers.norm")]


def _import_graph(modules) -> dict[str, set[str]]:
    """``module -> the segkv modules it imports``, from every import statement in the file (at the
    top, inside functions, under ``TYPE_CHECKING``). ``from package import name`` counts as an
    import of the submodule ``package.name`` where there is one, else of the package."""
    paths = dict((module, path) for path, module in modules)
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = graph.setdefault(module, set())
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in paths}
            elif isinstance(node, ast.ImportFrom) and node.module in paths:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in paths else node.module)
        targets.discard(module)
    return graph


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules that import each
    other, directly or through others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    cycles = []
    for group in groups:  # a shortest way back to the group's first module, for the message
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for module in frontier:
                for target in sorted(graph[module] & group):
                    if target == start:
                        cycle = paths[module] + [start]
                        break
                    if target not in paths:
                        paths[target] = paths[module] + [target]
                        nxt.append(target)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return sorted(cycles)


def test_no_import_cycles():
    """No two modules import each other, directly or through others, not even inside a package
    and not through imports inside functions or under ``TYPE_CHECKING``: a shared piece lives in
    the lower module (or a small module of its own), and an upper one reaches down."""
    cycles = _import_cycles(_import_graph(_modules()))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_cycle_checker_sees_a_cycle(tmp_path):
    """The checker itself works: a two-module cycle hidden by a function-level import and one
    hidden under ``TYPE_CHECKING`` are both reported; a one-way import is not."""
    pkg = tmp_path / "segkv" / "demo"
    pkg.mkdir(parents=True)
    (tmp_path / "segkv" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from segkv.demo.high import g\n    return g\n")
    (pkg / "high.py").write_text("from segkv.demo.low import f\n\ndef g():\n    return f\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from segkv.demo import b\n")
    (pkg / "b.py").write_text("import segkv.demo.a\n")
    (pkg / "c.py").write_text("from segkv.demo.low import f\n")
    modules = [(path, ".".join(path.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"))
               for path in sorted((tmp_path / "segkv").rglob("*.py"))]
    graph = _import_graph(modules)
    assert graph["segkv.demo.low"] == {"segkv.demo.high"} and graph["segkv.demo.a"] == {"segkv.demo.b"}
    assert _import_cycles(graph) == [["segkv.demo.a", "segkv.demo.b", "segkv.demo.a"],
                                     ["segkv.demo.high", "segkv.demo.low", "segkv.demo.high"]]
    assert _import_cycles({"x": {"y"}, "y": set()}) == []


def test_rule_checker_sees_function_level_and_type_checking_imports(tmp_path):
    """An upward import inside a function (a lazy import) or under ``TYPE_CHECKING`` is found
    like a top-level one: lazy imports of heavy modules are fine, but only downward."""
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from segkv.engine.llm import LLM\n\n"
                   "def f():\n    import segkv.server.app\n    from segkv.kernels import pdl\n")
    assert _segkv_imports(bad) == [("segkv.engine.llm", 3), ("segkv.server.app", 6), ("segkv.kernels", 7)]


def test_package_never_imports_the_benchmarks_or_tools():
    """benchmarks/ and tools/ sit outside segkv/ and outside the wheel: the package never reaches them."""
    for path, _ in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        outside = sorted(name for name in names if name.split(".")[0] in ("benchmarks", "tools"))
        assert not outside, f"{path.relative_to(PACKAGE.parent)} imports {outside}"


def test_tests_mirror_the_package():
    """tests/<part>/ holds the tests of segkv/<part>/ (or of benchmarks/); tests/ itself only the
    repository-wide checks and the command line."""
    tests = Path(__file__).resolve().parent
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {"benchmarks"}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders <= parts, f"test folders without a package part: {sorted(folders - parts)}"
    at_root = {p.stem for p in tests.glob("test_*.py")}
    assert at_root <= {"test_cli", "test_import_rules", "test_names_defined", "test_readme", "test_settings"}, \
        f"put these under the folder of what they test: {sorted(at_root)}"
    assert all(list(tests.joinpath(f).glob("test_*.py")) for f in folders)
