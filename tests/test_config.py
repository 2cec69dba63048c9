"""Configuration: YAML, environment overrides, flags, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from hloserve.cli import _apply_flags, _parser
from hloserve.config import EXAMPLE_REPOSITORY, load_config
from hloserve.errors import ConfigError


def test_defaults_serve_the_example_repository_on_loopback() -> None:
    config = load_config(environ={})
    assert config.server.model_repository == EXAMPLE_REPOSITORY
    assert (config.server.host, config.server.grpc_port, config.server.metrics_port) == (
        "127.0.0.1",
        8001,
        8002,
    )
    assert config.server.max_message_bytes >= 1 << 30
    assert config.scheduler.discipline == "fair"


def test_yaml_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "hloserve.yaml"
    path.write_text(
        "server:\n  grpc_port: 9001\n  host: 0.0.0.0\n"
        "scheduler:\n  max_queue_depth: 8\n  models:\n"
        "    mlp: {weight: 3, max_queue_delay_us: 500, preferred_batch_sizes: [4, 8]}\n"
    )
    config = load_config(
        path, environ={"HLOSERVE_SERVER_GRPC_PORT": "9002", "HLOSERVE_LOGGING_LEVEL": "debug"}
    )
    assert config.server.grpc_port == 9002
    assert config.server.host == "0.0.0.0"
    assert config.scheduler.max_queue_depth == 8
    assert config.scheduler.models["mlp"].weight == 3.0
    assert config.scheduler.models["mlp"].max_queue_delay_us == 500
    assert config.scheduler.models["mlp"].preferred_batch_sizes == (4, 8)
    assert config.logging.level == "debug"
    args = _parser().parse_args(["serve", "--grpc-port", "9003", "--model-repository", str(tmp_path)])
    flagged = _apply_flags(config, args)
    assert flagged.server.grpc_port == 9003
    assert flagged.server.model_repository == tmp_path
    assert not flagged.server.allow_client_shm  # shared memory is off unless asked for
    shm = _apply_flags(config, _parser().parse_args(["serve", "--allow-client-shm"]))
    assert shm.server.allow_client_shm
    assert load_config(environ={"HLOSERVE_SERVER_ALLOW_CLIENT_SHM": "true"}).server.allow_client_shm
    assert not flagged.server.reload
    assert _apply_flags(config, _parser().parse_args(["serve", "--reload"])).server.reload
    polled = _apply_flags(config, _parser().parse_args(["serve", "--repository-poll-secs", "0.5"])).server
    assert polled.reload and polled.repository_poll_s == 0.5  # Triton's flag turns polling on


@pytest.mark.parametrize(
    ("environ", "field", "says"),
    [
        ({"HLOSERVE_SERVER_GRPC_PORT": "eighty"}, "server.grpc_port", "expected an integer"),
        ({"HLOSERVE_SERVER_GRPC_PORT": "70000"}, "server.grpc_port", "0..65535"),
        ({"HLOSERVE_SCHEDULER_DISCIPLINE": "lifo"}, "scheduler.discipline", "fair, fifo, edf"),
        ({"HLOSERVE_SCHEDULER_MAX_QUEUE_DEPTH": "0"}, "scheduler.max_queue_depth", ">= 1"),
        ({"HLOSERVE_SERVER_NOPE": "1"}, "HLOSERVE_SERVER_NOPE", "no field 'nope'"),
        ({"HLOSERVE_NOPE_X": "1"}, "HLOSERVE_NOPE_X", "unknown section"),
        ({"HLOSERVE_SERVER_MAX_MESSAGE_BYTES": "12"}, "server.max_message_bytes", ">= 1048576"),
        ({"HLOSERVE_SERVER_KEEP_FREED_BYTES": str(1 << 31)}, "server.keep_freed_bytes", "2 GiB - 1"),
        ({"HLOSERVE_SERVER_KEEP_FREED_BYTES": "-1"}, "server.keep_freed_bytes", "must be 0"),
    ],
)
def test_bad_environment_value_names_the_field(environ: dict[str, str], field: str, says: str) -> None:
    with pytest.raises(ConfigError, match=rf"^config {field}: .*{says}"):
        load_config(environ=environ)


@pytest.mark.parametrize(
    ("text", "field", "says"),
    [
        ("server: {grpc_port: [1]}\n", "server.grpc_port", "expected an integer"),
        ("server: {colour: red}\n", "server.colour", "unknown field"),
        ("scheduler: {models: {mlp: {weight: 0}}}\n", "scheduler.models.mlp.weight", "> 0"),
        ("scheduler: {models: {mlp: {speed: 2}}}\n", "scheduler.models.mlp.speed", "unknown field"),
        (
            "scheduler: {models: {m: {preferred_batch_sizes: 4}}}\n",
            "m.preferred_batch_sizes",
            "expected a list",
        ),
        (
            "scheduler: {models: {m: {preferred_batch_sizes: [x]}}}\n",
            r"preferred_batch_sizes\[0\]",
            "an integer",
        ),
        ("gateway: {}\n", "gateway", "unknown section"),
        ("- 1\n", "", "expected a mapping"),
    ],
)
def test_bad_yaml_value_names_the_field(tmp_path: Path, text: str, field: str, says: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{field}.*{says}"):
        load_config(path, environ={})


def test_cli_reports_a_bad_config_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hloserve.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text("server: {grpc_port: -5}\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "server.grpc_port" in capsys.readouterr().err


def test_replace_converts_each_value_as_yaml_would_and_names_a_wrong_one(tmp_path: Path) -> None:
    config = load_config(environ={})
    replaced = config.replace("server", model_repository=str(tmp_path), grpc_port="9001")
    assert replaced.server.model_repository == tmp_path and replaced.server.grpc_port == 9001
    with pytest.raises(ConfigError, match=r"^config server.model_repository: .*expected a path"):
        config.replace("server", model_repository=3)
