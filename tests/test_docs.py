"""The documentation site builds with --strict (no broken link, no page left out of the nav),
and its generated configuration reference describes every field of the configuration."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from support.servers import ROOT

from hloserve import config


@pytest.mark.slow
def test_the_site_builds_strictly_with_every_configuration_field(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    page = (tmp_path / "configuration" / "index.html").read_text()
    hints = typing.get_type_hints(config.Config)
    for section in dataclasses.fields(config.Config):
        for field in dataclasses.fields(hints[section.name]):
            if field.name != "models":
                assert f"HLOSERVE_{section.name.upper()}_{field.name.upper()}" in page


def test_every_configuration_field_is_described() -> None:
    """The reference takes each field's meaning from the docstring under it: none may lack one."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.pop(0)
    classes = [typing.get_type_hints(config.Config)[f.name] for f in dataclasses.fields(config.Config)]
    for cls in [*classes, config.ModelSettings]:
        described = hooks.field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in described and f.name != "models"]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
