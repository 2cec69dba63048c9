"""A Triton model repository imported into an hloserve repository, model by model.

Each model directory is planned from its `config.pbtxt` (`triton_config.plan_model`), converted
from its highest version's ONNX file (`onnx_model.import_onnx`) into a staging directory inside
`out` and moved into place only once written and verified, so nothing half-converted is ever
served from `out`. One model's failure never stops the others; the report says which converted,
which did not and why, and which config fields were ignored. The serving settings taken from the
configs (queue delay, queue size, max batch size) go to `out/hloserve.yaml`, a config to serve
`out` with (`hloserve serve --config out/hloserve.yaml`).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hloserve.importers._staging import write_staged
from hloserve.importers.onnx_model import ImportedBundle, import_onnx, onnx_signature
from hloserve.importers.triton_config import (
    CONFIG_FILE,
    ModelPlan,
    NotConvertible,
    TensorPlan,
    TritonConfigError,
    autocomplete_config,
    empty_config,
    plan_model,
    read_model_config,
)

__all__ = ["SERVE_CONFIG", "ImportReport", "ModelOutcome", "import_triton_repository"]

SERVE_CONFIG = "hloserve.yaml"
"""The config written beside the bundles: the repository and each model's scheduling settings."""


@dataclass(frozen=True, slots=True)
class ModelOutcome:
    """One Triton model's import: converted (with its plan and checks) or not, and why."""

    name: str
    reason: str | None = None
    """Why it was not converted; None when it was."""
    plan: ModelPlan | None = None
    bundle: ImportedBundle | None = None
    seconds: float = 0.0
    autocompleted: bool = False
    """It had no config.pbtxt: its config was completed from the ONNX model, as Triton does."""

    @property
    def converted(self) -> bool:
        return self.reason is None

    @property
    def ignored(self) -> tuple[str, ...]:
        return self.plan.ignored if self.plan is not None else ()


@dataclass(frozen=True, slots=True)
class ImportReport:
    """Every model directory of the Triton repository, converted or not."""

    repository: Path
    out: Path
    outcomes: tuple[ModelOutcome, ...]
    serve_config: Path | None = None

    @property
    def converted(self) -> tuple[ModelOutcome, ...]:
        return tuple(o for o in self.outcomes if o.converted)

    @property
    def failed(self) -> tuple[ModelOutcome, ...]:
        return tuple(o for o in self.outcomes if not o.converted)

    def format(self) -> str:
        """The report as printed by `hloserve import triton`."""
        lines = [f"Triton repository {self.repository} -> {self.out}"]
        lines.append(f"converted ({len(self.converted)}):")
        for o in self.converted:
            assert o.plan is not None and o.bundle is not None
            sizes = (
                ", ".join(map(str, o.bundle.batch_sizes)) if o.bundle.batch_sizes else "none (whole shapes)"
            )
            checks = "; ".join(f"{c.name} {c.difference:.2g} <= {c.tolerance:.2g}" for c in o.bundle.checks)
            verified = f"agrees with ONNX Runtime ({checks})" if checks else "not verified"
            lines.append(
                f"  {o.name}: version {o.plan.version}, batch sizes {sizes}, {verified} [{o.seconds:.1f} s]"
            )
            if o.autocompleted:
                lines.append(f"    no {CONFIG_FILE}: config completed from the ONNX model, as Triton does")
            if o.plan.settings:
                lines.append(f"    settings: {', '.join(f'{k} {v}' for k, v in o.plan.settings.items())}")
            if o.ignored:
                lines.append(f"    ignored config.pbtxt fields: {', '.join(o.ignored)}")
        lines.append(f"not converted ({len(self.failed)}):")
        lines.extend(f"  {o.name}: {o.reason}" for o in self.failed)
        if self.serve_config is not None:
            lines.append(f"serve with: hloserve serve --config {self.serve_config}")
        return "\n".join(lines)


def import_triton_repository(
    repository: Path,
    out: Path,
    *,
    platform: str = "cpu",
    verify: bool = True,
    progress: Callable[[ModelOutcome], None] | None = None,
) -> ImportReport:
    """Import every model directory of the Triton `repository` into the hloserve repository `out`.

    A model whose bundle already exists in `out` is not touched (reported as not converted).
    `progress` is called with each model's outcome as it is decided.

    Raises:
        NotADirectoryError: `repository` is not a directory.
    """
    repository, out = Path(repository), Path(out)
    if not repository.is_dir():
        raise NotADirectoryError(f"Triton repository {str(repository)!r} is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    models = (p for p in repository.iterdir() if p.is_dir() and not p.name.startswith("."))
    for directory in sorted(p for p in models if p.resolve() != out.resolve()):  # --out inside REPO
        started = time.perf_counter()
        outcome = _import_model(directory, out, platform, verify)
        outcome = dataclasses.replace(
            outcome,
            seconds=time.perf_counter() - started,
            autocompleted=not (directory / CONFIG_FILE).is_file(),
        )
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    converted = [o for o in outcomes if o.converted]
    serve_config = _write_serve_config(out, converted) if converted else None
    return ImportReport(repository, out, tuple(outcomes), serve_config)


def _import_model(directory: Path, out: Path, platform: str, verify: bool) -> ModelOutcome:
    name = directory.name
    if (out / name).exists():
        return ModelOutcome(name, f"{out / name} already exists; remove it or import into another --out")
    config_file = directory / CONFIG_FILE
    try:
        if config_file.is_file():
            config = read_model_config(config_file)
        else:  # as Triton's auto-complete for an ONNX model
            config = autocomplete_config(_signature(plan_model(directory, empty_config()).model_file))
        plan = plan_model(directory, config)
    except (TritonConfigError, NotConvertible) as e:
        if config_file.is_file():
            return ModelOutcome(name, str(e))
        return ModelOutcome(name, f"no {CONFIG_FILE}, auto-completed as Triton does for ONNX models: {e}")

    def write(directory: Path) -> ImportedBundle:
        bundle = import_onnx(
            plan.model_file,
            directory,
            inputs=plan.inputs,
            outputs=plan.outputs,
            batch_sizes=plan.batch_sizes,
            platform=platform,
            verify=verify,
        )
        _add_labels(directory, plan)
        return dataclasses.replace(bundle, directory=out / name)

    try:
        bundle = write_staged(out / name, write)
    except NotConvertible as e:
        return ModelOutcome(name, str(e), plan)
    except Exception as e:  # one model's surprise never stops the others
        return ModelOutcome(name, f"{type(e).__name__}: {e}", plan)
    return ModelOutcome(name, None, plan, bundle)


def _signature(model_file: Path) -> tuple[list[TensorPlan], list[TensorPlan]]:
    import onnx

    try:
        return onnx_signature(onnx.load(str(model_file), load_external_data=False))
    except NotConvertible:
        raise
    except Exception as e:
        raise NotConvertible(f"{model_file} is not a readable ONNX model: {e}") from None


def _add_labels(directory: Path, plan: ModelPlan) -> None:
    """Copy each output's label file into the bundle and name it in the manifest."""
    labelled = {t.name: t.labels for t in plan.outputs if t.labels is not None}
    if not labelled:
        return
    manifest_file = directory / "manifest.yaml"
    manifest = yaml.safe_load(manifest_file.read_text())
    for tensor in manifest["executable_outputs"]:
        labels = labelled.get(tensor["name"])
        if labels is not None:
            shutil.copyfile(labels, directory / labels.name)
            tensor["labels"] = labels.name
    manifest_file.write_text(yaml.safe_dump(manifest, sort_keys=False))


def _write_serve_config(out: Path, converted: list[ModelOutcome]) -> Path:
    """`out/hloserve.yaml`: the repository and the converted models' settings, merged into what
    an earlier import wrote there."""
    path = out / SERVE_CONFIG
    config: dict[str, Any] = yaml.safe_load(path.read_text()) if path.is_file() else {}
    config = config if isinstance(config, dict) else {}
    config.setdefault("server", {})["model_repository"] = str(out.resolve())
    models = config.setdefault("scheduler", {}).setdefault("models", {})
    for o in converted:
        if o.plan is not None and o.plan.settings:
            models[o.name] = dict(o.plan.settings)
    if not models:
        del config["scheduler"]
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
