"""The `hloserve` command: `hloserve serve` runs a worker until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import structlog
import trio

from hloserve.config import Config, load_config
from hloserve.errors import ConfigError
from hloserve.logs import configure_logging

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hloserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model repository over KServe V2 gRPC",
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
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (default 8002; -1 turns it off)")
    serve.add_argument(
        "--allow-client-shm",
        action="store_true",
        default=None,
        help="accept Triton system shared-memory regions from clients (off by default)",
    )
    return parser


def _apply_flags(config: Config, args: argparse.Namespace) -> Config:
    changes = {
        field: value
        for field, value in (
            ("model_repository", args.model_repository),
            ("host", args.host),
            ("grpc_port", args.grpc_port),
            ("metrics_port", args.metrics_port),
            ("allow_client_shm", args.allow_client_shm),
        )
        if value is not None
    }
    return config.replace("server", **changes) if changes else config


async def _serve_until_signalled(config: Config) -> None:
    from hloserve.worker import serve  # imports JAX: only once we know we will serve

    log = structlog.get_logger("hloserve")
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with serve(config):
            async for signum in signals:
                log.info("signal received", signal=signal.Signals(signum).name)
                break
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = _apply_flags(load_config(args.config), args)
    except ConfigError as e:
        print(f"hloserve: {e}", file=sys.stderr)
        return 2
    configure_logging(config.logging)
    try:
        trio.run(_serve_until_signalled, config)
    except ConfigError as e:
        structlog.get_logger("hloserve").error("cannot start", error=str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
