"""docs/settings.md lists every ``STREAMGR_*`` environment setting the package reads, and no
setting it no longer reads (except those it names as dropped): a user reading it sees the
switches that exist, with their defaults."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A whole name: STREAMGR_ then words; ``STREAMGR_*`` and ``STREAMGR_TOPK_*`` (prose about
# families of settings) end in "_" or "*" and are not names.
NAME = re.compile(r"STREAMGR_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])")


def _read_by_package() -> set[str]:
    names: set[str] = set()
    for f in (ROOT / "streamgr").rglob("*.py"):
        names |= set(NAME.findall(f.read_text()))
    return names


def _doc() -> tuple[set[str], set[str]]:
    """(the settings in the tables, those named in the closing "Dropped" paragraph)."""
    text = (ROOT / "docs" / "settings.md").read_text()
    tables = {m for line in text.splitlines() if line.startswith("| `")
              for m in NAME.findall(line.split("|")[1])}
    dropped = set(NAME.findall(text[text.index("Dropped after measurement"):]))
    return tables, dropped


def test_every_setting_read_is_documented():
    tables, _ = _doc()
    missing = _read_by_package() - tables
    assert not missing, f"read by streamgr/ but not in docs/settings.md: {sorted(missing)}"


def test_no_documented_setting_is_dead():
    tables, dropped = _doc()
    read = _read_by_package()
    assert not tables - read, f"in docs/settings.md but read nowhere: {sorted(tables - read)}"
    assert not dropped & read, f"named as dropped but still read: {sorted(dropped & read)}"
    assert len(tables) >= 40  # the tables parsed (a format change would empty them)


def test_tools_use_only_real_settings():
    """Examples in tools' help and docstrings name settings that exist."""
    tables, _ = _doc()
    for f in (ROOT / "tools").rglob("*.py"):
        stale = set(NAME.findall(f.read_text())) - tables
        assert not stale, f"{f.name} names settings nothing reads: {sorted(stale)}"
