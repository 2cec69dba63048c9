"""`hloserve node`: one worker per GPU (or N on CPU) under a supervisor; with two or more workers,
Envoy in front of them on the public gRPC port and the controller (`hloserve.fleet`) beside it.
Given `node.workers_dns`, no worker of its own: Envoy and the controller front the workers that
name resolves to (a fleet's router).

The supervisor (`hloserve.fleet.supervisor`) keeps the children running; `hloserve.fleet.workers`
says which workers there are; this module plans the node and runs it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import trio

from hloserve.config import Config
from hloserve.fleet.supervisor import GaveUp, Supervisor
from hloserve.fleet.workers import WorkerSpec, worker_child, worker_specs

__all__ = ["NodePlan", "plan_node", "run_node"]

log = structlog.get_logger("hloserve.node")


@dataclass(frozen=True, slots=True)
class NodePlan:
    """What a node will run, settled before anything starts (so a bad setting stops it early)."""

    workers: Sequence[WorkerSpec]
    envoy: str | None  # the Envoy binary, with two workers or more


def plan_node(config: Config, environ: Mapping[str, str] | None = None) -> NodePlan:
    """The workers to start and the Envoy to front them; raises `ConfigError`. Given
    `node.workers_dns`, no worker: Envoy fronts the workers that name resolves to."""
    if config.node.workers_dns:
        from hloserve.fleet.envoy import find_envoy

        return NodePlan([], find_envoy(config.node.envoy))
    specs = worker_specs(config.node, os.environ if environ is None else environ)
    if len(specs) == 1:
        return NodePlan(specs, None)
    from hloserve.fleet.envoy import find_envoy

    return NodePlan(specs, find_envoy(config.node.envoy))


async def run_node(config: Config, plan: NodePlan, config_path: Path | None = None) -> str:
    """Run the node until cancelled; returns why it gave up if a child died past its budget."""
    supervisor = Supervisor(config.node)
    failures: list[str] = []
    try:
        async with trio.open_nursery() as nursery:
            if plan.envoy is None:
                (spec,) = plan.workers
                nursery.start_soon(supervisor.keep_running, worker_child(spec, config, config_path, True))
                log.info("node serving one worker directly", grpc_port=config.server.grpc_port)
            else:
                from hloserve.fleet.gateway import run_front

                await nursery.start(run_front, config, plan.workers, supervisor, plan.envoy)
                for spec in plan.workers:
                    child = worker_child(spec, config, config_path, False)
                    nursery.start_soon(supervisor.keep_running, child)
    except* GaveUp as group:
        failures += map(str, group.exceptions)
    return "; ".join(failures)  # keep_running returns only by giving up
