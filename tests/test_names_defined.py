"""Every name the code reads is defined: GPU-only paths (benchmarks, kernels' CUDA branches,
the device scripts) never run in CI, so a misspelt or removed name would otherwise surface only
on the GPU machine. pyflakes reads the source without running it."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyflakes import api, messages
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parent.parent
# What cannot be right in any branch: a name nobody defines, or one read before it exists.
FATAL = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collector(Reporter):
    def __init__(self):
        super().__init__(None, None)
        self.found: list[str] = []

    def flake(self, message):
        if isinstance(message, FATAL):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")


@pytest.mark.parametrize("folder", ["segkv", "benchmarks", "scripts", "tools", "tests"])
def test_every_name_read_is_defined(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    collector = _Collector()
    for path in files:
        api.checkPath(str(path), collector)
    assert collector.found == []


def test_the_check_finds_an_undefined_name(tmp_path):
    """The check itself: the benchmark's fault it guards against (a name left behind by a move)."""
    source = tmp_path / "moved.py"
    source.write_text("def build(cache):\n    return make(layout, cache)\n\n\ndef make(a, b):\n    return a, b\n")
    collector = _Collector()
    api.checkPath(str(source), collector)
    assert len(collector.found) == 1 and "undefined name 'layout'" in collector.found[0]
