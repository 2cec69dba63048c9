"""The stated public API (docs/api.md) and the Python in the docs: every name the docs import
imports, every public module's `__all__` is on the page, and every snippet in README.md and
docs/ runs as its marker says.

Each ```python block follows a marker line, `<!-- snippet: KIND -->`, where KIND is how it runs:
`run` (a fresh interpreter), `model.py` (loaded as the model.py of the bundle it registers, by
the server's loader), `spec FUNCTION` (`hloserve export spec.py:FUNCTION`), `server` (against a
worker on the example repository, its port put in place of 8001), `embed` (a program that serves:
it must print the gRPC port it bound) or `compile: WHY` (needs what a test cannot give, e.g. TLS
certificates: compiled only).
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.clients import free_port
from support.servers import EXAMPLES, ROOT, Worker, start_worker

from hloserve.models.model_py import load_model_py

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PUBLIC = ["hloserve", "hloserve.config", "hloserve.export", "hloserve.export.torch", "hloserve.client"]
"""The modules users import from (docs/api.md); each one's `__all__` must be listed there."""
KINDS = ("run", "model.py", "spec", "server", "embed", "compile")
_BLOCK = re.compile(r"^(?:<!-- snippet: (?P<marker>[^\n]*?) -->\n)?```python\n(?P<code>.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    marker: str
    code: str

    @property
    def kind(self) -> str:
        return self.marker.split(":")[0].split()[0] if self.marker else ""

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _snippets() -> list[Snippet]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in _BLOCK.finditer(text):
            line = text.count("\n", 0, block.start("code"))
            found.append(Snippet(page, line, block["marker"] or "", block["code"]))
    return found


SNIPPETS = _snippets()


def _of_kind(*kinds: str) -> list[Snippet]:
    return [snippet for snippet in SNIPPETS if snippet.kind in kinds]


def _run(code: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    (cwd / "snippet.py").write_text(code)
    return subprocess.run(
        [sys.executable, "snippet.py"], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )  # fmt: skip


def test_every_python_snippet_says_how_it_runs() -> None:
    assert len(SNIPPETS) >= 10
    unmarked = [str(s) for s in SNIPPETS if s.kind not in KINDS]
    assert unmarked == [], f"add <!-- snippet: KIND --> before each, KIND one of {KINDS}"


def _imports_in(code: str) -> Iterator[tuple[str, str | None]]:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hloserve":
            yield from ((node.module or "", alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names if alias.name.split(".")[0] == "hloserve")


def test_every_name_the_docs_import_imports() -> None:
    """Every `from hloserve... import name` in a snippet or in the text's inline code resolves."""
    statements = [s.code for s in SNIPPETS]
    for page in PAGES:
        statements += re.findall(
            r"`((?:from hloserve[\w.]* import [\w, ]+)|(?:import hloserve[\w.]*))`", page.read_text()
        )
    imported = {pair for code in statements for pair in _imports_in(code)}
    assert ("hloserve.export", "InputSpec") in imported and ("hloserve", "register_model") in imported
    for module, name in sorted(imported, key=str):
        loaded = importlib.import_module(module)
        assert name is None or hasattr(loaded, name), f"`from {module} import {name}` fails"


def test_the_api_page_lists_every_public_name() -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    listed = {pair for code in re.findall(r"```python\n(.*?)```", page, re.S) for pair in _imports_in(code)}
    for module in PUBLIC:
        public = set(importlib.import_module(module).__all__)
        missing = public - {name for listed_module, name in listed if listed_module == module}
        assert not missing, f"{module} exports {sorted(missing)}, which docs/api.md does not list"


def test_the_old_paths_are_the_new_objects() -> None:
    """A name that moved is the same object at its old path, not a copy that could drift."""
    from hloserve import buffer_pool, client, export, export_torch, verification
    from hloserve.export import jax, torch
    from hloserve.export import verification as new_verification

    assert export.InputSpec is jax.InputSpec and export.export_bundle is jax.export_bundle
    assert export_torch.export_torch_bundle is torch.export_torch_bundle
    assert verification.precision_tolerance is new_verification.precision_tolerance
    assert buffer_pool.BufferPool is client.BufferPool


@pytest.mark.parametrize("snippet", _of_kind("compile"), ids=str)
def test_a_snippet_that_needs_what_a_test_lacks_compiles(snippet: Snippet) -> None:
    assert snippet.marker.partition(":")[2].strip(), f"{snippet}: say what it needs, after `compile:`"
    compile(snippet.code, str(snippet), "exec")


@pytest.mark.parametrize("snippet", _of_kind("run"), ids=str)
def test_a_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    ran = _run(snippet.code, tmp_path)
    assert ran.returncode == 0, f"{snippet}: {ran.stderr[-2000:]}"


@pytest.mark.parametrize("snippet", _of_kind("model.py"), ids=str)
def test_a_model_py_snippet_registers_through_the_loader(snippet: Snippet, tmp_path: Path) -> None:
    (name,) = re.findall(r"^register_(?:meta_)?model\(\"(\w+)\"", snippet.code, re.M)
    (tmp_path / name).mkdir()
    (tmp_path / name / "model.py").write_text(snippet.code)
    registration = load_model_py(name, tmp_path / name / "model.py", tmp_path)
    assert registration.hooks is not None or registration.meta_run is not None


@pytest.mark.slow
@pytest.mark.parametrize("snippet", _of_kind("spec"), ids=str)
def test_a_spec_snippet_exports_a_bundle(snippet: Snippet, tmp_path: Path) -> None:
    """`hloserve export spec.py:FUNCTION` writes (and verifies) the bundle, as the page says."""
    (tmp_path / "spec.py").write_text(snippet.code)
    for function in snippet.marker.split()[1:]:
        exported = subprocess.run(
            [sys.executable, "-m", "hloserve.cli", "export", f"spec.py:{function}", "--out", function],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert exported.returncode == 0, f"{snippet}: {exported.stderr[-2000:]}"
        assert (tmp_path / function / "manifest.yaml").is_file()


@pytest.fixture(scope="module", name="example_server")
def _example_server() -> Iterator[Worker]:
    with start_worker() as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("snippet", _of_kind("server"), ids=str)
def test_a_client_snippet_runs_against_a_worker(
    snippet: Snippet, example_server: Worker, tmp_path: Path
) -> None:
    assert re.search(r"\b8001\b", snippet.code), f"{snippet}: a server snippet names the gRPC port 8001"
    ran = _run(re.sub(r"\b8001\b", str(example_server.grpc_port), snippet.code), tmp_path)
    assert ran.returncode == 0, f"{snippet}: {ran.stderr[-2000:]}"
    assert ran.stdout.strip(), f"{snippet} printed nothing"


@pytest.mark.slow
@pytest.mark.parametrize("snippet", _of_kind("embed"), ids=str)
def test_an_embedding_snippet_serves(snippet: Snippet, tmp_path: Path) -> None:
    """The program serves the example repository on the port its environment names, and says so."""
    port = free_port()
    environ = {
        **os.environ,
        "HLOSERVE_SERVER_MODEL_REPOSITORY": str(EXAMPLES),
        "HLOSERVE_SERVER_GRPC_PORT": str(port),
        "HLOSERVE_SERVER_HTTP_PORT": "-1",
        "HLOSERVE_SERVER_METRICS_PORT": "-1",
    }
    (tmp_path / "snippet.py").write_text(snippet.code)
    process = subprocess.Popen(
        [sys.executable, "snippet.py"], cwd=tmp_path, env=environ, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert process.stdout is not None
    with process.stdout:
        try:
            printed = next((line.strip() for line in process.stdout if line.strip().isdigit()), None)
            assert printed == str(port), f"{snippet} printed no port before exiting {process.poll()}"
        finally:
            process.kill()
            process.wait(30)
