"""MkDocs hook: the configuration reference, generated from `hloserve.config` at every build.

Each field's type, default and meaning come from the dataclasses themselves (the meaning from
the docstring under the field), its environment variable from the naming rule, its flag from
`hloserve.cli.SERVER_FLAGS`; so a field added to the code appears here without anyone editing
the page, and the page cannot describe a field that is gone.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import typing
from pathlib import Path
from typing import Any

from hloserve import cli, config

MARKER = "<!-- configuration reference -->"


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, on one line."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(hint))
    text = getattr(hint, "__name__", None) or str(hint)
    return text.replace("typing.", "").replace("pathlib.", "").replace("|", "\\|")


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is dataclasses.MISSING:
        return "(per model)" if field.default_factory is not dataclasses.MISSING else ""
    value = field.default
    if isinstance(value, Path) and value == config.EXAMPLE_REPOSITORY:
        return "the shipped example repository"
    if isinstance(value, str):
        return f'`"{value}"`'
    return "`null`" if value is None else f"`{value!r}`".replace("True", "true").replace("False", "false")


def _table(section: str, cls: type, env: bool) -> str:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = ["| field | type | default | environment / flag | what it does |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.name == "models":
            continue
        where = [f"`{config.ENV_PREFIX}{section.upper()}_{field.name.upper()}`"] if env else []
        if section == "server" and field.name in cli.SERVER_FLAGS:
            where.append(f"`{cli.SERVER_FLAGS[field.name]}`")
        rows.append(
            f"| `{field.name}` | {_type_name(hints[field.name])} | {_default(field)} | "
            f"{'<br>'.join(where) or 'file only'} | {docs.get(field.name, '')} |"
        )
    return "\n".join(rows)


def reference() -> str:
    """The whole reference: one table per section, then the per-model settings."""
    parts = []
    for field in dataclasses.fields(config.Config):
        cls = typing.get_type_hints(config.Config)[field.name]
        parts.append(f"### `{field.name}`\n\n{_table(field.name, cls, env=True)}\n")
    parts.append(
        "### `scheduler.models.<name>`\n\nPer-model settings, in the file only.\n\n"
        + _table("scheduler.models", config.ModelSettings, env=False)
        + "\n"
    )
    return "\n".join(parts)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARKER, reference()) if MARKER in markdown else markdown
