"""The `hloserve` command: `hloserve serve` runs a worker until SIGINT or SIGTERM; `hloserve node`
runs one worker per GPU (or N on CPU) behind one endpoint; `hloserve export` writes a bundle from
a JAX, Flax or PyTorch model described by a Python function; `hloserve import` converts a Triton
repository's ONNX models, or one ONNX file, into bundles."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import trio

from hloserve.allocator import keep_freed_memory, limit_arenas, settle_heap
from hloserve.config import Config, LoggingConfig, load_config
from hloserve.errors import ConfigError
from hloserve.export._torchvision import prepare_torchvision_import
from hloserve.extras import EXTRAS, require_extra
from hloserve.logs import configure_logging
from hloserve.memory_probe import start_memory_probe

if TYPE_CHECKING:
    from hloserve.fleet.node import NodePlan

__all__ = ["SERVER_FLAGS", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hloserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model repository over KServe V2 gRPC and REST",
        description="Serve a model repository. Settings come from --config, then HLOSERVE_<SECTION>_<FIELD> "
        "environment variables, then these flags. To listen on every interface, pass --host 0.0.0.0.",
    )
    serve.add_argument("--config", type=Path, help="YAML configuration file")
    serve.add_argument(
        "--model-repository",
        type=Path,
        help="directory of bundles (default: the shipped examples/repository)",
    )
    serve.add_argument("--host", help="listen address (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port (default 8001; 0 picks a free one)")
    serve.add_argument(
        "--http-port", type=int, help="KServe V2 REST port (default 8000; 0: a free one; -1 turns it off)"
    )
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (default 8002; -1 turns it off)")
    serve.add_argument(
        "--allow-client-shm",
        action="store_true",
        default=None,
        help="accept Triton system shared-memory regions from clients (off by default)",
    )
    serve.add_argument(
        "--reload",
        action="store_true",
        default=None,
        help="watch the repository: reload a changed model.py or bundle, load added and unload removed "
        "bundles (for development; a failed reload keeps the old version)",
    )
    serve.add_argument(
        "--repository-poll-secs",
        type=float,
        help="how often --reload scans the repository (default 1; as Triton's flag, implies --reload)",
    )
    serve.add_argument(
        "--frontends",
        type=int,
        help="frontend processes sharing the public ports in front of this engine (default 0: one process)",
    )
    _add_access_flags(serve)
    _add_export_command(commands)
    _add_import_command(commands)
    _add_node_command(commands)
    return parser


def _add_node_command(commands: Any) -> None:
    node = commands.add_parser(
        "node",
        help="serve a repository from one worker per GPU (or N CPU workers) behind one endpoint",
        description="Run a node: one worker per GPU (or --cpu-workers N), restarted when it dies. With two "
        "workers or more, Envoy serves the public gRPC and REST ports, routing each request by its model, "
        "and a controller places models and answers the RPCs that span workers (needs hloserve[node]). "
        "Settings as for `serve`, plus the `node` section (HLOSERVE_NODE_<FIELD>).",
    )
    node.add_argument("--config", type=Path, help="YAML configuration file (read by every worker too)")
    node.add_argument("--model-repository", type=Path, help="directory of bundles, served by every worker")
    node.add_argument("--host", help="public listen address (default 127.0.0.1)")
    node.add_argument("--grpc-port", type=int, help="public gRPC port (default 8001)")
    node.add_argument(
        "--http-port", type=int, help="public KServe V2 REST port (default 8000; -1 turns it off)"
    )
    node.add_argument("--metrics-port", type=int, help="public metrics, /healthz and /readyz (default 8002)")
    node.add_argument(
        "--allow-client-shm", action="store_true", default=None, help="as for `serve`, on every worker"
    )
    _add_access_flags(node, " (Envoy's listeners, and every worker's restrictions)")
    node.add_argument("--cpu-workers", type=int, help="run N CPU workers instead of one per GPU")
    node.add_argument("--gpus", help="auto (default), a count, or comma-separated ordinals or UUIDs")
    node.add_argument(
        "--scheduling",
        choices=["round_robin", "least_outstanding", "lpt_packing"],
        help="how requests are spread over the workers serving a model (default round_robin)",
    )


def _boolean(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_access_flags(parser: argparse.ArgumentParser, where: str = "") -> None:
    """Triton's restriction and TLS flags (theirs for gRPC; the REST ones named alike)."""
    for flag, what in (
        ("--grpc-restricted-protocol", "gRPC protocol groups; header triton-grpc-protocol-<key>"),
        ("--http-restricted-api", "REST API groups; header <key>"),
    ):
        parser.add_argument(
            flag,
            action="append",
            metavar="<groups>:<key>=<value>",
            help=f"restrict {what} (as Triton's flag; repeatable; docs/security.md){where}",
        )
    for proto, name in (("grpc", "gRPC"), ("http", "REST")):
        parser.add_argument(
            f"--{proto}-use-ssl",
            nargs="?",
            const=True,
            type=_boolean,
            help=f"serve {name} over TLS with --{proto}-server-cert and --{proto}-server-key{where}",
        )
        parser.add_argument(
            f"--{proto}-use-ssl-mutual",
            nargs="?",
            const=True,
            type=_boolean,
            help=f"also require client certificates signed by --{proto}-root-cert (implies TLS)",
        )
        for part, what in (
            ("server-cert", "server certificate"),
            ("server-key", "its key"),
            ("root-cert", "CAs"),
        ):
            parser.add_argument(f"--{proto}-{part}", type=Path, help=f"PEM file of the {name} {what}")
    parser.add_argument(
        "--metrics-use-ssl",
        nargs="?",
        const=True,
        type=_boolean,
        help=f"serve metrics over TLS with --http-server-cert and --http-server-key{where}",
    )


SERVER_FLAGS = {
    "model_repository": "--model-repository",
    "host": "--host",
    "grpc_port": "--grpc-port",
    "http_port": "--http-port",
    "metrics_port": "--metrics-port",
    "allow_client_shm": "--allow-client-shm",
    "reload": "--reload",
    "repository_poll_s": "--repository-poll-secs",
    "frontends": "--frontends",
    "grpc_restricted_protocol": "--grpc-restricted-protocol",
    "http_restricted_api": "--http-restricted-api",
    "grpc_use_ssl": "--grpc-use-ssl",
    "grpc_use_ssl_mutual": "--grpc-use-ssl-mutual",
    "grpc_server_cert": "--grpc-server-cert",
    "grpc_server_key": "--grpc-server-key",
    "grpc_root_cert": "--grpc-root-cert",
    "http_use_ssl": "--http-use-ssl",
    "http_use_ssl_mutual": "--http-use-ssl-mutual",
    "http_server_cert": "--http-server-cert",
    "http_server_key": "--http-server-key",
    "http_root_cert": "--http-root-cert",
    "metrics_use_ssl": "--metrics-use-ssl",
}
"""The `server` fields `hloserve serve` takes as flags (the configuration reference lists them)."""


def _apply_flags(config: Config, args: argparse.Namespace) -> Config:
    given = {field: getattr(args, flag[2:].replace("-", "_"), None) for field, flag in SERVER_FLAGS.items()}
    if given["repository_poll_s"] is not None:  # as Triton's flag: polling implies reloading
        given["reload"] = True
    changes = {field: value for field, value in given.items() if value is not None}
    for field in ("grpc_restricted_protocol", "http_restricted_api"):  # repeatable flags
        if field in changes:
            changes[field] = tuple(changes[field])
    return config.replace("server", **changes) if changes else config


async def _serve_until_signalled(config: Config) -> None:
    from hloserve.worker import serve  # imports JAX: only once we know we will serve

    log = structlog.get_logger("hloserve")
    keep_freed_memory(config.server.keep_freed_bytes)  # the binary owns its process's allocator
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with serve(config):
            settle_heap()
            start_memory_probe(config.logging, "engine")
            async for signum in signals:
                log.info("signal received", signal=signal.Signals(signum).name)
                break
    log.info("stopped")


async def _node_until_signalled(config: Config, plan: NodePlan, config_path: Path | None) -> int:
    from hloserve.fleet.node import run_node

    log = structlog.get_logger("hloserve.node")
    status = 0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    log.info("signal received; stopping the node", signal=signal.Signals(signum).name)
                    break
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signal)
            # As an engine does: a node proxies every load and unload, whose names churn the
            # interned-string table (its one rebuild was a 1.9 MB step after ~12,000 cycles).
            settle_heap()
            start_memory_probe(config.logging, "node")
            failure = await run_node(config, plan, config_path)
            log.error("node stopping: a child keeps dying", error=failure)
            status = 1
            nursery.cancel_scope.cancel()
    log.info("node stopped")
    return status


_EXPORT_HELP = """\
Export a model as a bundle. SPEC is FILE.py:FUNCTION (or package.module:FUNCTION): a function
taking no arguments that returns the exporter's keyword arguments as a dict, for example

  JAX:      {"fn": apply, "params": params, "inputs": [InputSpec("X", (16,))]}
  Flax:     {"fn": nnx_module, "params": None, "inputs": [InputSpec("X", (16,))]}
  PyTorch:  {"module": torch_module, "example_inputs": (torch.randn(2, 3, 32, 32),)}

(InputSpec and OutputSpec come from hloserve.export.jax). A dict with "module" goes to
hloserve.export.torch.export_torch_bundle, any other to hloserve.export.jax.export_bundle; it may
carry their other options (outputs, description, sample_inputs, rtol...), and the flags below
override it. The bundle is reloaded in a fresh process and checked against the model unless
--no-verify. Exit status: 0 written (and verified), 1 the model cannot be exported or does not
verify, 2 a bad SPEC.
"""


class _BadSpec(Exception):
    """The SPEC argument of `hloserve export` names nothing usable."""


def _batch_sizes(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,4,8, got {text!r}"
        ) from None


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _ratio(text: str) -> float:
    value = _tolerance(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _add_export_command(commands: Any) -> None:
    export = commands.add_parser(
        "export",
        help="export a JAX, Flax or PyTorch model as a bundle",
        description=_EXPORT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("spec", metavar="SPEC", help="FILE.py:FUNCTION returning the exporter's arguments")
    export.add_argument("--out", type=Path, required=True, help="bundle directory; its name is the model's")
    export.add_argument(
        "--batch-sizes", type=_batch_sizes, help="compiled batch sizes, e.g. 1,4,8 (default 1)"
    )
    export.add_argument(
        "--no-batch-axis",
        action="store_true",
        help="the inputs' shapes are whole: no batch axis, one module, each request run alone",
    )
    export.add_argument("--platform", choices=["cpu", "cuda"], help="platform to lower for (default cpu)")
    export.add_argument(
        "--bytecode", action="store_true", help="write StableHLO portable artifacts instead of text"
    )
    export.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        help="float type of the weights and the computation (default fp32, the model's own); "
        "bf16 and fp16 halve the weight bytes, clients still send and get the same dtypes",
    )
    export.add_argument("--no-verify", action="store_true", help="skip the fresh-process check")
    export.add_argument(
        "--no-tune",
        action="store_true",
        help="compile with XLA's default options; do not time the candidates the exporter tries",
    )
    export.add_argument(
        "--rtol",
        type=_tolerance,
        help="verification: allowed difference as a fraction of each element "
        "(default by dtype: 1e-4 for f32)",
    )
    export.add_argument(
        "--atol",
        type=_tolerance,
        help="verification: allowed difference as a fraction of each output's largest magnitude "
        "(default by dtype: 1e-5 for f32)",
    )
    scratch = export.add_mutually_exclusive_group()
    scratch.add_argument(
        "--max-scratch-ratio",
        type=_ratio,
        help="refuse a module whose XLA scratch exceeds this multiple of its weights, inputs and "
        "outputs (default 16)",
    )
    scratch.add_argument(
        "--allow-large-scratch", action="store_true", help="report a module's scratch, never refuse it"
    )


def _load_spec(spec: str) -> dict[str, Any]:
    """The exporter's keyword arguments, from the function SPEC names."""
    target, colon, attribute = spec.rpartition(":")
    if not colon or not target or not attribute:
        raise _BadSpec(f"expected FILE.py:FUNCTION or package.module:FUNCTION, got {spec!r}")
    prepare_torchvision_import()  # a spec importing torchvision or timm beside a CPU torch
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise _BadSpec(f"no file {target!r}")
            sys.path.insert(0, str(path.resolve().parent))  # so the spec can import its neighbours
            found = importlib.util.spec_from_file_location(path.stem, path)
            assert found is not None and found.loader is not None  # a .py path always has a loader
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        function = getattr(module, attribute, None)
        if not callable(function):
            raise _BadSpec(f"{target!r} has no function {attribute!r}")
        options = function()
    except _BadSpec:
        raise
    except ImportError as e:
        extra = next((x for x, modules in EXTRAS.items() if e.name and e.name.split(".")[0] in modules), None)
        if extra is None:
            raise _BadSpec(f"{spec} failed: {traceback.format_exception_only(e)[-1].strip()}") from e
        raise _BadSpec(f"{spec} needs the `{extra}` extra ({e}): pip install 'hloserve[{extra}]'") from e
    except Exception as e:
        raise _BadSpec(f"{spec} failed: {traceback.format_exception_only(e)[-1].strip()}") from e
    if not isinstance(options, Mapping):
        raise _BadSpec(f"{spec} returned {type(options).__name__}, expected a dict of exporter arguments")
    return dict(options)


def _export(args: argparse.Namespace) -> int:
    try:
        options = _load_spec(args.spec)
    except _BadSpec as e:
        print(f"hloserve export: {e}", file=sys.stderr)
        return 2
    for option, value in (
        ("batch_sizes", args.batch_sizes),
        ("batch_axis", False if args.no_batch_axis else None),
        ("platform", args.platform),
        ("module_format", "bytecode" if args.bytecode else None),
        ("verify", False if args.no_verify else None),
        ("tune", False if args.no_tune else None),
        ("precision", args.precision),
        ("rtol", args.rtol),
        ("atol", args.atol),
        ("max_scratch_ratio", args.max_scratch_ratio),
    ):
        if value is not None:
            options[option] = value
    if args.allow_large_scratch:
        options["max_scratch_ratio"] = None
    if "module" in options:
        try:
            require_extra("torch", "module", f"{args.spec} returned a PyTorch module, which")
        except ConfigError as e:
            print(f"hloserve export: {e.problem}", file=sys.stderr)
            return 2
    from hloserve.export.jax import VerificationError, export_bundle  # imports JAX: not for --help

    exporter: Callable[..., Path] = export_bundle
    if "module" in options:
        from hloserve.export.torch import export_torch_bundle

        exporter = export_torch_bundle
    # export_torch_bundle hands the options it does not name on to export_bundle.
    known = {*inspect.signature(exporter).parameters, *inspect.signature(export_bundle).parameters}
    try:
        inspect.signature(exporter).bind(directory=args.out, **options)
        if set(options) - known:
            raise TypeError(f"unexpected keyword argument(s) {sorted(set(options) - known)}")
    except TypeError as e:
        print(
            f"hloserve export: {args.spec} returned arguments {exporter.__name__} cannot take: {e}",
            file=sys.stderr,
        )
        return 2
    configure_logging(LoggingConfig())  # a progress line per batch size, on stderr
    try:
        directory = exporter(directory=args.out, **options)
    except (ValueError, VerificationError) as e:
        print(f"hloserve export: {e}", file=sys.stderr)
        return 1
    structlog.get_logger("hloserve").info("bundle written", directory=str(directory))
    return 0


_IMPORT_HELP = """\
Convert models from other servers' formats into bundles (needs the `onnx` extra:
pip install 'hloserve[onnx]'). ONNX files go through onnx2torch and the PyTorch exporter, and
each bundle is compared with ONNX Runtime on random inputs at every batch size.

  hloserve import triton REPO --out DIR
      every model directory of a Triton repository (config.pbtxt, highest version's model.onnx);
      prints which converted and which did not, and why; writes DIR/hloserve.yaml
  hloserve import onnx MODEL.onnx --out DIR --batch-sizes 1,4,8
      one file; DIR is the bundle, named after its directory

Exit status: 0 every model converted, 1 some did not, 2 bad arguments.
"""


def _add_import_command(commands: Any) -> None:
    imports = commands.add_parser(
        "import",
        help="convert a Triton repository or an ONNX file into bundles",
        description=_IMPORT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sources = imports.add_subparsers(dest="source", required=True)
    triton = sources.add_parser("triton", help="a Triton model repository (ONNX models)")
    triton.add_argument("repository", metavar="REPO", type=Path, help="the Triton model repository")
    triton.add_argument("--out", type=Path, required=True, help="the hloserve repository to write into")
    onnx = sources.add_parser("onnx", help="one ONNX file")
    onnx.add_argument("model", metavar="MODEL.onnx", type=Path, help="the ONNX file")
    onnx.add_argument("--out", type=Path, required=True, help="bundle directory; its name is the model's")
    onnx.add_argument("--batch-sizes", type=_batch_sizes, help="compiled batch sizes, e.g. 1,4,8 (default 1)")
    onnx.add_argument(
        "--no-batch-axis", action="store_true", help="whole shapes: the model's first axis is not a batch"
    )
    onnx.add_argument(
        "--dims",
        action="append",
        default=[],
        metavar="INPUT=D1,D2,...",
        help="sizes of an input's axes after the batch axis, for axes the ONNX file leaves dynamic",
    )
    for command in (triton, onnx):
        command.add_argument(
            "--platform", choices=["cpu", "cuda"], default="cpu", help="platform to lower for"
        )
        command.add_argument("--no-verify", action="store_true", help="skip the comparison with ONNX Runtime")


def _import(args: argparse.Namespace) -> int:
    from hloserve.importers import import_onnx_file, import_triton_repository
    from hloserve.importers.triton_config import NotConvertible

    try:
        require_extra("onnx", "import", "hloserve import")
    except ConfigError as e:
        print(f"hloserve import: {e.problem}", file=sys.stderr)
        return 2
    configure_logging(LoggingConfig())  # a progress line per batch size, on stderr
    if args.source == "triton":
        if not args.repository.is_dir():
            print(f"hloserve import: {args.repository} is not a directory", file=sys.stderr)
            return 2
        report = import_triton_repository(
            args.repository, args.out, platform=args.platform, verify=not args.no_verify
        )
        print(report.format())
        return 0 if not report.failed else 1
    if args.batch_sizes is not None and args.no_batch_axis:
        print("hloserve import: --batch-sizes cannot go with --no-batch-axis", file=sys.stderr)
        return 2
    dims: dict[str, tuple[int, ...]] = {}
    for item in args.dims:
        name, equals, sizes = item.partition("=")
        try:
            dims[name] = tuple(int(d) for d in sizes.split(","))
        except ValueError:
            equals = ""
        if not equals or not name:
            print(f"hloserve import: --dims takes INPUT=D1,D2,..., got {item!r}", file=sys.stderr)
            return 2
    try:
        bundle = import_onnx_file(
            args.model,
            args.out,
            dims=dims,
            batch_sizes=None if args.no_batch_axis else (args.batch_sizes or [1]),
            platform=args.platform,
            verify=not args.no_verify,
        )
    except (NotConvertible, FileExistsError, FileNotFoundError) as e:
        print(f"hloserve import: {args.model}: {e}", file=sys.stderr)
        return 1
    checks = "; ".join(f"{c.name} {c.difference:.2g} <= {c.tolerance:.2g}" for c in bundle.checks)
    print(f"{bundle.directory}: written{f', agrees with ONNX Runtime ({checks})' if checks else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "export":
        return _export(args)
    if args.command == "import":
        return _import(args)
    try:  # every setting, and the extras they need, before anything starts: one line, exit 2
        config = _apply_flags(load_config(args.config), args)
        limit_arenas(config.server.malloc_arenas)  # before JAX's and trio's threads exist
        from hloserve.engine.tracing import check_tracing  # imports JAX: after the file's checks

        check_tracing(config.tracing)
        plan = None
        if args.command == "node":
            from hloserve.fleet.node import plan_node

            changes = {"cpu_workers": args.cpu_workers, "gpus": args.gpus, "scheduling": args.scheduling}
            config = config.replace("node", **{k: v for k, v in changes.items() if v is not None})
            plan = plan_node(config)
    except ConfigError as e:
        print(f"hloserve: {e}", file=sys.stderr)
        return 2
    configure_logging(config.logging)
    try:
        if plan is not None:
            return trio.run(_node_until_signalled, config, plan, args.config)
        trio.run(_serve_until_signalled, config)
    except ConfigError as e:
        structlog.get_logger("hloserve").error("cannot start", error=str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
