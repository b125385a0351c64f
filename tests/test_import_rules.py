"""ARCHITECTURE.md's layout rules: imports go downward only; kernels and cache stay narrow."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "segkv"
VALUE_MODULES = {"config", "sampling_params", "outputs"}
# Rank of each part: a module may import parts of lower rank (and its own part).
RANK = {
    "value": 0,
    "kernels": 1,
    "cache": 1,
    "attention": 2,
    "layers": 3,
    "models": 4,
    "runner": 5,
    "scheduler": 5,
    "engine": 6,
    "server": 7,
    "bench": 8,
    "cli": 9,  # the command wires everything, benchmarks included
    "root": 8,
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
            outside = [name for name, _ in _segkv_imports(path) if not name.startswith("segkv.kernels")]
            assert not outside, f"{path}: kernels import only torch, triton and other kernels"


def test_cache_bookkeeping_is_pure_python():
    """Only cache/storage.py (the owner of the tensors) imports torch inside cache/."""
    for path in (PACKAGE / "cache").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if path.name != "storage.py":
            assert "torch" not in names, f"{path.name} imports torch; only storage.py may"


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
