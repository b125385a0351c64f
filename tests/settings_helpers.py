"""Changing an environment variable in a test: segkv reads its settings once, at import, so the
test re-reads them into ``segkv.settings.SETTINGS``; monkeypatch restores both afterwards."""

from __future__ import annotations

import segkv.settings as settings


def setenv(monkeypatch, name: str, value: str | None) -> None:
    """Set ``name`` to ``value`` (None: unset it) and re-read the settings (a bad value raises here)."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(settings, "SETTINGS", settings.load_settings())
