"""What each of hloserve's patches relies on in a library, declared as data and checked at
start-up, so that a different version fails loudly before serving instead of misbehaving later.

A patch module lists `Requires(patch, distribution, version, members, parameters)`: the version
it was written for, the dotted names it reaches into, and the parameter names of the functions
it overrides or calls. `check` raises
`PatchMismatch` naming every difference and what to do about it.
"""

from __future__ import annotations

import dis
import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["PatchMismatch", "Requires", "check", "missing"]


class PatchMismatch(RuntimeError):
    """A library differs from the one a patch was written for; raised at start-up, never while
    serving (so it is no `HloserveError`, which are answered to clients)."""

    def __init__(self, patch: str, distribution: str, expected: str, problems: list[str]) -> None:
        self.patch, self.distribution, self.problems = patch, distribution, problems
        super().__init__(
            f"{patch} was written for {distribution} {expected}: {'; '.join(problems)}. "
            f"Install {distribution}=={expected} (as pyproject pins it), or update {patch} "
            "for the version installed and pin that"
        )


@dataclass(frozen=True, slots=True)
class Requires:
    """One library as a patch (`patch`, a module name) relies on it."""

    patch: str
    distribution: str
    version: str
    members: tuple[str, ...] = ()
    """Dotted names that must resolve: a module's global, a class's attribute, or an attribute
    of its instances, which a method of the class assigns (`grpclib.server.Stream._stream`)."""
    parameters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """A function's dotted name and its parameter names, in order."""


def _resolve(dotted: str) -> Any:
    """The object `dotted` names; raises LookupError when it does not resolve."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for i, name in enumerate(parts[split:], split):
            if hasattr(found, name):
                found = getattr(found, name)
            elif i == len(parts) - 1 and isinstance(found, type) and _assigned_by_methods(found, name):
                return None  # an instance attribute: there is no object to return
            else:
                raise LookupError(dotted)
        return found
    raise LookupError(dotted)


def _assigned_by_methods(cls: type, name: str) -> bool:
    """Whether a method of `cls` (or of a base) assigns attribute `name`: how an attribute of
    its instances shows in a class."""
    for klass in cls.__mro__:
        for member in vars(klass).values():
            code = getattr(member, "__code__", None)
            if code is not None and any(
                op.opname == "STORE_ATTR" and op.argval == name for op in dis.get_instructions(code)
            ):
                return True
    return False


def missing(members: tuple[str, ...]) -> list[str]:
    """Those of the dotted names `members` that do not resolve."""
    absent = []
    for dotted in members:
        try:
            _resolve(dotted)
        except LookupError:
            absent.append(dotted)
    return absent


def _problems(requires: Requires) -> list[str]:
    try:
        found = version(requires.distribution)
    except PackageNotFoundError:
        found = "(not installed)"
    problems = []
    if found != requires.version:
        problems.append(f"version {found} is installed, {requires.version} expected")
    problems.extend(f"{dotted} is missing" for dotted in missing(requires.members))
    for dotted, expected in requires.parameters.items():
        try:
            function = _resolve(dotted)
        except LookupError:
            problems.append(f"{dotted} is missing")
            continue
        actual = tuple(inspect.signature(function).parameters)
        if actual != expected:
            problems.append(f"{dotted} takes ({', '.join(actual)}), not ({', '.join(expected)})")
    return problems


def check(*requirements: Requires) -> None:
    """Raise `PatchMismatch` unless every requirement holds."""
    for requires in requirements:
        problems = _problems(requires)
        if problems:
            raise PatchMismatch(requires.patch, requires.distribution, requires.version, problems)
