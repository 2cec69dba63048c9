"""The documentation site builds with --strict (no broken link, no page left out of the nav),
and its generated configuration reference describes every field of the configuration."""

from __future__ import annotations

import configparser
import dataclasses
import os
import re
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


def test_ci_runs_exactly_the_readme_s_test_command_and_its_envs_exist() -> None:
    """CI runs the README's second command, so a user who runs it runs what CI ran; every tox
    env it names is defined (tox would otherwise fail only on the machine that runs it)."""
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "&& tox -e" in line and "tests" in line)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1]  # `python` is its venv's python3
    assert ci.split("tox -e ")[1] == command.split("tox -e ")[1], (ci, command)
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    envs = command.split("tox -e ", 1)[1].split(",")
    defined = {section.removeprefix("testenv:") for section in tox.sections()}
    defined |= {f"py3{minor}" for minor in ("12", "13") if "testenv:py3{12,13}" in tox.sections()}
    assert set(envs) <= defined, set(envs) - defined
    assert "tests" in envs and "long" in envs


def test_the_lint_env_runs_the_ruff_the_dev_extra_pins() -> None:
    """`tox -e lint` installs ruff alone (not the package): the same release the dev extra pins,
    so lint in tox and in a developer's venv agree on every rule and format."""
    import tomllib

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pinned = [d for d in dev if d.startswith("ruff==")]
    assert tox["testenv:lint"]["skip_install"] == "true"
    assert tox["testenv:lint"]["deps"].split() == pinned, (tox["testenv:lint"]["deps"], pinned)


def _tox_on_a_missing_python(tmp_path: Path, tox_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Runs tox under the project's [tox] section on a throwaway tox.ini: one env on this Python
    and one (`py39x`) naming a Python no machine has, with `tox_env` the only TOX_ variables."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    settings = "\n".join(f"{key} = {value}" for key, value in tox["tox"].items() if key != "envlist")
    (tmp_path / "tox.ini").write_text(
        f"[tox]\n{settings}\n\n[testenv]\nskip_install = true\ncommands = python -c \"print('ran')\"\n\n"
        "[testenv:here]\n\n[testenv:py39x]\nbase_python = python3.99\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("TOX_")} | tox_env
    return subprocess.run(
        [sys.executable, "-m", "tox", "-e", "here,py39x", "--workdir", str(tmp_path / ".tox")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_readme_s_command_skips_a_missing_interpreter_and_ci_fails_on_it(tmp_path: Path) -> None:
    """On a machine with one Python the README's command passes and its summary names the envs
    it skipped; `.ci/run` exports the setting that makes the same missing Python fail the run."""
    skipped = _tox_on_a_missing_python(tmp_path, {})
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert re.search(r"^\s*py39x: SKIP\b", skipped.stdout, re.M), skipped.stdout
    assert re.search(r"^\s*here: OK\b", skipped.stdout, re.M), skipped.stdout

    ci = (ROOT / ".ci" / "run").read_text()
    exports = dict(re.findall(r"^export (TOX_\w+)=(\S+)$", ci, re.M))
    assert exports.get("TOX_SKIP_MISSING_INTERPRETERS") == "false", exports
    mandatory = _tox_on_a_missing_python(tmp_path, exports)
    assert mandatory.returncode != 0, mandatory.stdout
    assert re.search(r"^\s*py39x: FAIL\b", mandatory.stdout, re.M), mandatory.stdout
