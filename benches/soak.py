"""Soak: mixed load for a long time, every answer checked, memory per process (`python -m benches soak`).

Options: `--duration` (seconds, default 600), `--frontends K` (`hloserve serve --frontends K`),
`--node` (`hloserve node --cpu-workers 2` instead of one serve).

The catalogue is the issue 38 operator's: 40 copies of the example `cnn` (`cnn0`..`cnn39`), `cnn`
and `mlp`, with a weight budget of a fifth of the catalogue's weights, so models swap all the time.
The load, all at once, from threads of this process:

* 4 gRPC and 2 REST clients (tritonclient) sending one fixed input per model, models picked by a
  Zipf law (s = 1.1); each answer is compared with the first answer of that model (within 1e-5);
* churn: every 0.5 s an unpopular model (the Zipf tail's half) is unloaded, or loaded back;
* a reader of the repository index, the statistics and `/metrics`, every second;
* a shared-memory client: registers a system region, sends `mlp` requests through it (input and
  output), unregisters it and starts over, every 20 requests;
* a hot reload of `mlp` (RepositoryModelLoad of a model served: replaced in place) every 2 min;
* clients that go away mid-request: a gRPC call cancelled after 1 ms, and a REST request whose
  connection closes halfway through its body, every 0.2 s.

Errors a client gets for a model the churn has unloaded (NOT_FOUND, UNAVAILABLE, "unloaded") are
counted apart; every other error and every wrong answer is a failure.

Every `--duration / 10` seconds (at most a minute) each server process is sampled: resident
memory, descriptors and threads from /proc, and from inside (`hloserve.memory_probe`, which the
soak turns on through `HLOSERVE_LOGGING_MEMORY_PROBE_DIR`; it runs tracemalloc, so the server is
slower than it would be) the Python heap, glibc's bytes in use and freed but kept, and the heap's
top growth by line since warm-up. `--no-trace` leaves tracemalloc off (no heap figures): the
server's own speed and allocation pattern, for the RSS it would have in production. The table
gives, per process (the engine, each frontend; through the node, its supervisor, each worker and
its frontends, and Envoy, whose allocator figures are tcmalloc's from its admin `/memory`), the
slope of each after warm-up (the first third of the run, at most 3 minutes) by least squares, in
MB per minute; RSS is also split into anonymous and file-backed pages (a library's code read in
late is not a leak), and its slope is given over the run's last half.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benches.serving import ROOT, _free_port

VARIANTS = 40
ZIPF_S = 1.1
CLIENTS_GRPC, CLIENTS_REST = 4, 2
CHURN_S, READ_S, RELOAD_S, DISCONNECT_S = 0.5, 1.0, 120.0, 0.2
SHM_REQUESTS = 20
"""Requests through one registered region before it is unregistered and registered again."""
TOLERANCE = 1e-5
MB = 1 << 20


@dataclass
class Process:
    """One server process's samples: (seconds since the load began, figures)."""

    role: str
    pid: int
    samples: list[tuple[float, dict[str, Any]]] = field(default_factory=list)


@dataclass
class Totals:
    answers: int = 0
    wrong: int = 0
    errors: int = 0
    """Failures other than the churn's (an unloaded model), wrong answers not counted."""
    churn_errors: int = 0
    cycles: int = 0
    """Unloads and loads by the churn client."""
    reloads: int = 0
    reads: int = 0
    shm_requests: int = 0
    disconnects: int = 0
    first_errors: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(what[:300])


@dataclass
class Result:
    setup: str
    duration_s: float
    warm_up_s: float
    totals: Totals
    processes: list[Process]
    command: str = ""

    def slope(self, process: Process, key: str, since_s: float | None = None) -> float | None:
        """`key`'s slope after warm-up (or after `since_s`), in its unit per minute (None: too few
        samples)."""
        since_s = self.warm_up_s if since_s is None else since_s
        points = [(t, _read(s, key)) for t, s in process.samples if t >= since_s]
        points = [(t, v) for t, v in points if v is not None]
        if len(points) < 3:
            return None
        t, v = np.array(points, dtype=float).T
        return float(np.polyfit(t / 60, v, 1)[0])

    def late_rss_slope(self, process: Process) -> float | None:
        """RSS's slope over the run's last half, in bytes per minute."""
        return self.slope(process, "rss_bytes", since_s=self.duration_s / 2)


def _read(sample: dict[str, Any], key: str) -> float | None:
    value: Any = sample
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value)


# -- the catalogue ----------------------------------------------------------------------------


def _catalogue(directory: Path) -> int:
    """The repository (40 cnn copies, cnn, mlp); returns its weight bytes."""
    examples = ROOT / "examples" / "repository"
    for name in ("cnn", "mlp"):
        shutil.copytree(examples / name, directory / name)
    for i in range(VARIANTS):
        target = directory / f"cnn{i}"
        shutil.copytree(examples / "cnn", target)
        manifest = target / "manifest.yaml"
        manifest.write_text(manifest.read_text().replace("name: cnn\n", f"name: cnn{i}\n", 1))
    return sum(p.stat().st_size for p in directory.glob("*/weights.safetensors"))


def _models() -> list[str]:
    """By popularity, most popular first: mlp, cnn, then the copies."""
    return ["mlp", "cnn", *(f"cnn{i}" for i in range(VARIANTS))]


def _input(model: str) -> tuple[str, np.ndarray]:
    if model == "mlp":
        return "INPUT0", np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    return "IMAGE", np.linspace(-1, 1, 16 * 16 * 3, dtype=np.float32).reshape(1, 16, 16, 3)


def _output(model: str) -> str:
    return "OUTPUT0" if model == "mlp" else "LOGITS"


# -- the server -------------------------------------------------------------------------------


@dataclass
class _Server:
    process: subprocess.Popen[bytes]
    grpc: int
    http: int
    metrics: int | None
    probes: Path


def _start(repository: Path, budget: int, frontends: int, node: bool, probes: Path) -> _Server:
    grpc, http = _free_port(), _free_port()
    metrics = None if node else _free_port()
    env = {
        **os.environ,
        "HLOSERVE_LOGGING_FORMAT": "json",
        "HLOSERVE_LOGGING_LEVEL": "warning",
        "HLOSERVE_LOGGING_MEMORY_PROBE_DIR": str(probes),
        "HLOSERVE_WEIGHTS_BUDGET_BYTES": str(budget),
        "HLOSERVE_SERVER_ALLOW_CLIENT_SHM": "true",
    }
    if node:
        env["HLOSERVE_NODE_DISCOVERY_INTERVAL_S"] = "0.5"
        command = ["node", "--cpu-workers", "2", "--metrics-port", "-1"]
    else:
        command = ["serve", "--metrics-port", str(metrics)]
        if frontends:
            command += ["--frontends", str(frontends)]
    command = [sys.executable, "-m", "hloserve.cli", *command, "--model-repository", str(repository),
               "--grpc-port", str(grpc), "--http-port", str(http)]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            try:
                if client.is_server_ready() and all(client.is_model_ready(m) for m in _models()):
                    return _Server(process, grpc, http, metrics, probes)
            except Exception:
                pass
            if process.poll() is not None:
                raise RuntimeError(f"the server exited ({process.returncode}): {' '.join(command)}")
            time.sleep(0.5)
    finally:
        client.close()
    process.kill()
    raise RuntimeError("the server did not become ready in 300 s")


def _stop(server: _Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(60)
    except subprocess.TimeoutExpired:
        server.process.kill()


def _tree(pid: int) -> list[tuple[str, int]]:
    """The server's processes by role: engine/worker, frontend, envoy, node (the supervisor)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            argv = Path(f"/proc/{parent}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "hloserve.frontends.frontend" in argv:
            role = "frontend"
        elif "serve" in argv:
            role = "engine"
        elif "node" in argv:
            role = "node"
        elif any("envoy" in a for a in argv[:1]):
            role = "envoy"
        else:
            role = Path(argv[0]).name or "?"
        found.append((role, parent))
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                frontier += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def _proc(pid: int) -> dict[str, Any] | None:
    try:
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        return {
            "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
            "rss_anon_bytes": int(status["RssAnon"].split()[0]) * 1024,
            "rss_file_bytes": int(status["RssFile"].split()[0]) * 1024,
            "descriptors": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"]),
        }
    except (OSError, KeyError):
        return None


PROBED = ("heap_bytes", "allocator", "interned_strings", "top_growth")
"""What each sample keeps of a process's memory-probe line."""


def _envoy_memory(pid: int) -> dict[str, Any]:
    """Envoy's allocator figures as the memory probe gives glibc's (empty if it cannot tell): its
    admin `/memory` (at the port of the bootstrap its `-c` names) says what tcmalloc holds from
    the system in all (its metadata included), what of it is allocated, and how much more its
    page heap and caches keep mapped (freed but kept). Envoy's anonymous RSS grows as its
    allocator first touches pages it already holds, so what it holds is that growth's ceiling."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        bootstrap = json.loads(Path(argv[argv.index("-c") + 1]).read_text())
        port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/memory", timeout=5) as answer:
            memory = {key: int(value) for key, value in json.load(answer).items()}
    except (OSError, ValueError, KeyError, IndexError):
        return {}
    mapped = memory["heap_size"] - memory["pageheap_unmapped"]
    held, allocated = memory["total_physical_bytes"], memory["allocated"]
    return {"allocator": {"heap": held, "in_use": allocated, "free": mapped - allocated}}


def _probe(probes: Path, pid: int) -> dict[str, Any]:
    """The process's latest memory-probe line (empty where it writes none)."""
    paths = list(probes.glob(f"*-{pid}.jsonl"))
    if not paths:
        return {}
    lines = paths[0].read_text().splitlines()
    return json.loads(lines[-1]) if lines else {}


# -- the load ---------------------------------------------------------------------------------


class _Load:
    """Every client of the soak, as threads until `stop` is set."""

    def __init__(self, server: _Server, node: bool) -> None:
        self.server, self.node = server, node
        self.url = f"127.0.0.1:{server.grpc}"
        self.stop = threading.Event()
        self.totals = Totals()
        self.lock = threading.Lock()
        self.references: dict[str, np.ndarray] = {}
        models = _models()
        self.popular, self.unpopular = models[: len(models) // 2], models[len(models) // 2 :]
        weights = 1.0 / np.arange(1, len(models) + 1) ** ZIPF_S
        self.models, self.weights = models, weights / weights.sum()
        self.unloaded: set[str] = set()

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            setattr(self.totals, key, getattr(self.totals, key) + n)

    def check(self, model: str, answer: np.ndarray) -> None:
        with self.lock:
            reference = self.references.setdefault(model, answer.copy())
            self.totals.answers += 1
            if reference.shape != answer.shape or not np.allclose(
                answer, reference, rtol=TOLERANCE, atol=TOLERANCE
            ):
                self.totals.wrong += 1

    def error(self, model: str, e: BaseException) -> None:
        text = str(e)
        churned = model in self.unpopular and any(
            s in text.lower()
            for s in (
                "not_found",
                "not found",
                "not served",
                "unavailable",
                "unloaded",
                "unknown model",
                "not ready",
            )
        )
        with self.lock:
            if churned:
                self.totals.churn_errors += 1
            else:
                self.totals.fail(f"{model}: {text}")

    def threads(self) -> list[threading.Thread]:
        workers: list[Callable[..., None]] = [
            *[lambda i=i: self._grpc(i) for i in range(CLIENTS_GRPC)],
            *[lambda i=i: self._rest(i) for i in range(CLIENTS_REST)],
            self._churn, self._reader, self._shm, self._reload, self._disconnect,
        ]  # fmt: skip
        return [threading.Thread(target=w, daemon=True) for w in workers]

    def _pick(self, rng: np.random.Generator) -> str:
        return str(self.models[rng.choice(len(self.models), p=self.weights)])

    def _grpc(self, seed: int) -> None:
        import tritonclient.grpc as grpcclient

        rng = np.random.default_rng(seed)
        client = grpcclient.InferenceServerClient(
            self.url, channel_args=[("grpc.use_local_subchannel_pool", 1)]
        )
        while not self.stop.is_set():
            model = self._pick(rng)
            name, array = _input(model)
            tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            try:
                result = client.infer(model, [tensor], client_timeout=60)
            except Exception as e:
                self.error(model, e)
                continue
            self.check(model, result.as_numpy(_output(model)))
        client.close()

    def _rest(self, seed: int) -> None:
        import tritonclient.http as httpclient

        rng = np.random.default_rng(100 + seed)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{self.server.http}", network_timeout=60)
        while not self.stop.is_set():
            model = self._pick(rng)
            name, array = _input(model)
            tensor = httpclient.InferInput(name, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array, binary_data=bool(rng.integers(2)))
            try:
                result = client.infer(model, [tensor])
            except Exception as e:
                self.error(model, e)
                continue
            self.check(model, result.as_numpy(_output(model)))
        client.close()

    def _churn(self) -> None:
        import tritonclient.grpc as grpcclient

        rng = np.random.default_rng(7)
        client = grpcclient.InferenceServerClient(self.url)
        while not self.stop.wait(CHURN_S):
            model = str(rng.choice(self.unpopular))
            try:
                if model in self.unloaded:
                    client.load_model(model)
                    self.unloaded.discard(model)
                else:
                    self.unloaded.add(model)  # before: its requests fail from now on
                    client.unload_model(model)
                self.count("cycles")
            except Exception as e:
                self.totals.fail(f"churn {model}: {e}")
        for model in sorted(self.unloaded):  # leave the catalogue whole
            client.load_model(model)
        client.close()

    def _reader(self) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.url)
        while not self.stop.wait(READ_S):
            try:
                client.get_model_repository_index()
                client.get_inference_statistics()
                if self.server.metrics is not None:
                    url = f"http://127.0.0.1:{self.server.metrics}/metrics"
                    with urllib.request.urlopen(url, timeout=30) as answer:
                        answer.read()
                self.count("reads")
            except Exception as e:
                self.totals.fail(f"reader: {e}")
        client.close()

    def _shm(self) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.utils.shared_memory as shm

        client = grpcclient.InferenceServerClient(self.url)
        name, array = _input("mlp")
        key = f"/hloserve-soak-{os.getpid()}"
        region = shm.create_shared_memory_region("soak", key, array.nbytes + 4096)
        try:
            while not self.stop.is_set():
                client.register_system_shared_memory("soak", key, array.nbytes + 4096)
                for _ in range(SHM_REQUESTS):
                    shm.set_shared_memory_region(region, [array])
                    tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
                    tensor.set_shared_memory("soak", array.nbytes)
                    output = grpcclient.InferRequestedOutput("OUTPUT0")
                    output.set_shared_memory("soak", 16, offset=array.nbytes)
                    try:
                        client.infer("mlp", [tensor], outputs=[output], client_timeout=60)
                    except Exception as e:
                        self.error("mlp", e)
                        continue
                    self.check(
                        "mlp/shm", shm.get_contents_as_numpy(region, np.float32, [1, 4], offset=array.nbytes)
                    )
                    self.count("shm_requests")
                client.unregister_system_shared_memory("soak")
        except Exception as e:
            self.totals.fail(f"shm: {e}")
        finally:
            shm.destroy_shared_memory_region(region)
            client.close()

    def _reload(self) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.url)
        while not self.stop.wait(RELOAD_S):
            try:
                client.load_model("mlp")  # served: replaced in place, its requests flowing on
                self.count("reloads")
            except Exception as e:
                self.totals.fail(f"reload: {e}")
        client.close()

    def _disconnect(self) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.url)
        name, array = _input("cnn")
        array = np.repeat(array, 4, axis=0)
        tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        while not self.stop.wait(DISCONNECT_S):
            try:  # cancelled client-side after 1 ms: mostly while the server works on it
                client.infer("cnn", [tensor], client_timeout=0.001)
            except Exception:
                pass
            body = json.dumps({"inputs": [{"name": name, "shape": [4, 16, 16, 3], "datatype": "FP32",
                                           "data": array.ravel().tolist()}]}).encode()  # fmt: skip
            try:
                with socket.create_connection(("127.0.0.1", self.server.http), timeout=5) as sock:
                    sock.sendall(
                        b"POST /v2/models/cnn/infer HTTP/1.1\r\nHost: soak\r\n"
                        + b"Content-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body[: len(body) // 2]
                    )
            except OSError:
                pass
            self.count("disconnects")
        client.close()


# -- the run ----------------------------------------------------------------------------------


def soak(duration_s: float = 600, frontends: int = 0, node: bool = False, trace: bool = True) -> Result:
    setup = "node (2 CPU workers)" if node else f"serve --frontends {frontends}" if frontends else "serve"
    interval = min(60.0, duration_s / 10)
    warm_up_s = min(duration_s / 3, 180.0)
    probe_env = {
        "HLOSERVE_LOGGING_MEMORY_PROBE_S": str(interval / 2),  # fresh at each sample
        "HLOSERVE_LOGGING_MEMORY_PROBE_TRACE": str(trace).lower(),
        "HLOSERVE_LOGGING_MEMORY_PROBE_BASELINE_S": str(warm_up_s),  # top growth after warm-up
    }
    with tempfile.TemporaryDirectory(prefix="hloserve-soak-") as scratch:
        repository, probes = Path(scratch) / "repository", Path(scratch) / "probes"
        repository.mkdir()
        budget = _catalogue(repository) // 5
        os.environ.update(probe_env)
        try:
            server = _start(repository, budget, frontends, node, probes)
        finally:
            for name in probe_env:
                del os.environ[name]
        load = _Load(server, node)
        processes: dict[int, Process] = {}
        threads = load.threads()
        try:
            for t in threads:
                t.start()
            started = time.monotonic()
            while True:
                now = time.monotonic() - started
                roles = Counter[str]()
                for role, pid in _tree(server.process.pid):
                    figures = _proc(pid)
                    if figures is None:
                        continue
                    probe = _envoy_memory(pid) if role == "envoy" else _probe(probes, pid)
                    figures.update({k: probe[k] for k in PROBED if k in probe})
                    roles[role] += 1
                    processes.setdefault(pid, Process(f"{role}{roles[role] - 1}", pid)).samples.append(
                        (now, figures)
                    )
                now_totals = load.totals
                progress = (
                    f"{now_totals.answers} answers, {now_totals.wrong} wrong, {now_totals.errors} errors"
                )
                print(f"soak {setup}: {now:.0f} s, {progress}", file=sys.stderr, flush=True)
                if now >= duration_s:
                    break
                time.sleep(min(interval, duration_s - now))
        finally:
            load.stop.set()
            for t in threads:
                t.join(90)
            _stop(server)
    return Result(setup, duration_s, warm_up_s, load.totals, list(processes.values()))


def run(
    window_ms: int = 3000, duration_s: float = 600, frontends: int = 0, node: bool = False, trace: bool = True
) -> list[Result]:
    return [soak(duration_s, frontends, node, trace)]


_SLOPES = (
    ("RSS", "rss_bytes", MB),
    ("anonymous", "rss_anon_bytes", MB),
    ("file-backed", "rss_file_bytes", MB),
    ("heap", "heap_bytes", MB),
    ("malloc heap", "allocator.heap", MB),
    ("malloc used", "allocator.in_use", MB),
    ("malloc free", "allocator.free", MB),
    ("malloc mapped", "allocator.mapped", MB),  # blocks glibc mmapped: not in its bytes in use
    ("fds", "descriptors", 1),
    ("threads", "threads", 1),
)


def table(rows: list[Result]) -> str:
    lines = []
    for r in rows:
        t = r.totals
        lines.append(
            f"{r.setup}, {r.duration_s / 60:.1f} min (slopes after {r.warm_up_s / 60:.1f} min of warm-up): "
            f"{t.answers} answers, {t.wrong} wrong, {t.errors} errors, {t.churn_errors} churn errors, "
            f"{t.cycles} load/unload, {t.reloads} reloads, {t.shm_requests} shm requests, "
            f"{t.disconnects} disconnects, {t.reads} reads"
        )
        lines += [f"  error: {e}" for e in t.first_errors]
        header = (
            "process",
            "pid",
            "RSS MB start",
            "end",
            *(f"{name} /min" for name, _, _ in _SLOPES),
            "RSS /min, last half",
        )
        lines.append(" | ".join(header))
        for p in r.processes:
            warm = [s for t_, s in p.samples if t_ >= r.warm_up_s] or [p.samples[-1][1]]
            cells = [
                p.role,
                str(p.pid),
                f"{warm[0]['rss_bytes'] / MB:.1f}",
                f"{warm[-1]['rss_bytes'] / MB:.1f}",
            ]
            for _, key, unit in _SLOPES:
                slope = r.slope(p, key)
                cells.append("-" if slope is None else f"{slope / unit:+.3f}")
            late = r.late_rss_slope(p)
            cells.append("-" if late is None else f"{late / MB:+.3f}")
            lines.append(" | ".join(cells))
            growth = warm[-1].get("top_growth") or []
            lines += [
                f"    heap +{g['bytes'] / 1024:.0f} KiB ({g['blocks']:+d} blocks) {g['line']}"
                for g in growth[:3]
            ]
    return "\n".join(lines)


def as_json(rows: list[Result]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        slopes = {p.role: {key: r.slope(p, key) for _, key, _ in _SLOPES} for p in r.processes}
        late = {p.role: r.late_rss_slope(p) for p in r.processes}
        out.append({**asdict(r), "slopes_per_minute": slopes, "rss_per_minute_last_half": late})
    return out
