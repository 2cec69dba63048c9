"""A program embedding the worker (`async with hloserve.serve(config)`) serves calls with deadlines,
in its main thread or another, whatever it imported first.

Each case runs in a fresh interpreter, since the import order is the point: on Python 3.12 and
newer a library that binds `asyncio.current_task` before trio-asyncio replaces it (grpclib, anyio)
answered every gRPC call with a deadline UNKNOWN "Internal Server Error".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from support.servers import EXAMPLES, ROOT

PROGRAM = textwrap.dedent(
    """
    import sys, threading, pathlib
    {first_imports}
    import numpy as np, trio, trio_asyncio
    import tritonclient.grpc as grpcclient, tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    import hloserve

    def calls(grpc_port, http_port):
        x = np.ones((2, 16), np.float32)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{{grpc_port}}")
        tensor = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
        tensor.set_data_from_numpy(x)
        assert client.infer("mlp", [tensor], client_timeout=30).as_numpy("OUTPUT0").shape == (2, 4)
        try:
            client.infer("nope", [tensor], client_timeout=30)
        except InferenceServerException as e:
            assert e.status() == "StatusCode.NOT_FOUND", (e.status(), e.message())
        else:
            raise AssertionError("an unknown model was served")
        rest = httpclient.InferenceServerClient(f"127.0.0.1:{{http_port}}", network_timeout=30)
        tensor = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        tensor.set_data_from_numpy(x)
        assert rest.infer("mlp", [tensor], timeout=30_000_000).as_numpy("OUTPUT0").shape == (2, 4)
        client.close()
        rest.close()

    async def main():
        config = hloserve.load_config(environ={{}})
        repository = pathlib.Path({repository!r})
        config = config.replace(
            "server", model_repository=repository, grpc_port=0, http_port=0, metrics_port=0
        )
        async with trio_asyncio.open_loop():
            async with hloserve.serve(config) as worker:
                await trio.to_thread.run_sync(calls, worker.grpc_port, worker.http_port)

    if {in_thread}:
        failed = []
        def run():
            try:
                trio.run(main)
            except BaseException as e:
                failed.append(e)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
    else:
        trio.run(main)
    print("served")
    """
)

FIRST_IMPORTS = {
    "hloserve_first": "",
    # what the suite (and many clients) import before the worker: grpclib, its stubs, Starlette
    "grpclib_first": "import grpclib.client, grpclib.utils, betterproto2.grpclib, starlette.applications",
    "client_first": "import hloserve.client, anyio._backends._asyncio",
}


@pytest.mark.slow
@pytest.mark.parametrize("first", FIRST_IMPORTS)
@pytest.mark.parametrize("in_thread", [False, True], ids=["main_thread", "other_thread"])
def test_an_embedded_worker_serves_calls_with_deadlines(first: str, in_thread: bool) -> None:
    program = PROGRAM.format(
        first_imports=FIRST_IMPORTS[first], repository=str(EXAMPLES), in_thread=in_thread
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("served")
    assert "no running event loop" not in done.stderr
