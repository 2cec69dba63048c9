"""deploy/Dockerfile, parsed by BuildKit's own parser (no container daemon here to build it): it
runs as user 1000, enters through the `hloserve` command, copies only files that exist and
that .dockerignore lets through, serves /mnt/models on every interface, and bakes in no model."""

from __future__ import annotations

import tomllib
from typing import Any

import dockerfile

from hloserve.config import ServerConfig

from .support import ROOT

COMMANDS = dockerfile.parse_file(str(ROOT / "deploy" / "Dockerfile"))
FINAL = COMMANDS[max(i for i, c in enumerate(COMMANDS) if c.cmd == "FROM") :]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _final(cmd: str) -> list[Any]:
    return [c for c in FINAL if c.cmd == cmd]


def test_it_runs_as_user_1000() -> None:
    (user,) = _final("USER")
    assert user.value == ("1000",)
    (run,) = _final("RUN")
    assert "useradd --uid 1000" in run.value[0]


def test_the_entry_point_is_hloserve_serve_or_node() -> None:
    (entrypoint,) = _final("ENTRYPOINT")
    (cmd,) = _final("CMD")
    assert entrypoint.json and entrypoint.value == ("hloserve",)  # exec form: SIGTERM reaches it
    assert cmd.json and cmd.value == ("serve",)
    assert PYPROJECT["project"]["scripts"]["hloserve"] == "hloserve.cli:main"


def test_every_copied_file_exists_and_is_not_ignored() -> None:
    allowed = [
        line.removeprefix("!")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    copies = [c for c in COMMANDS if c.cmd in ("COPY", "ADD")]
    assert copies and all(c.cmd == "COPY" and not c.flags for c in copies)  # none from elsewhere
    for copy in copies:
        for source in copy.value[:-1]:
            assert (ROOT / source).exists(), source
            assert any(source == a or source.startswith(a + "/") for a in allowed), source


def test_the_package_builds_from_what_is_copied() -> None:
    """setuptools' package directories are all copied, so the wheel builds in the image."""
    copied = {s for c in COMMANDS if c.cmd == "COPY" for s in c.value[:-1]}
    directories = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert directories <= copied | {"src"}, directories - copied
    assert {"pyproject.toml", "README.md", "LICENSE"} <= copied


def test_it_serves_the_mounted_repository_on_every_interface() -> None:
    env = dict(zip(*[iter(v for c in _final("ENV") for v in c.value)] * 2, strict=True))
    assert env["HLOSERVE_SERVER_MODEL_REPOSITORY"] == "/mnt/models"
    assert env["HLOSERVE_SERVER_HOST"] == "0.0.0.0"
    for name in env:
        if name.startswith("HLOSERVE_SERVER_"):
            assert hasattr(ServerConfig, name.removeprefix("HLOSERVE_SERVER_").lower()), name
    (expose,) = _final("EXPOSE")
    config = ServerConfig()
    assert expose.value == tuple(str(p) for p in (config.http_port, config.grpc_port, config.metrics_port))


def test_no_model_is_baked_in_and_the_variants_are_extras() -> None:
    assert not _final("COPY")  # the final stage only installs the wheels built before it
    assert not any("/mnt/models" in v for c in COMMANDS if c.cmd in ("COPY", "RUN") for v in c.value)
    variant = [c.value[0] for c in COMMANDS if c.cmd == "ARG" and c.value[0].startswith("VARIANT=")]
    assert variant and set(variant) == {"VARIANT=cpu"}
    assert {"cuda12", "cuda13"} <= set(PYPROJECT["project"]["optional-dependencies"])
