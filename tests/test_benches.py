"""The breakdown bench's patched servers serve what they claim (`python -m benches breakdown`)."""

from __future__ import annotations

import export_examples
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support.numerics import assert_close

from benches.serving import _free_port, start_server


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["no execution", "no actors", "canned reply"])
def test_breakdown_variant_answers_and_keeps_statistics(variant: str) -> None:
    port = _free_port()
    server = start_server(port, module=("benches.breakdown", variant))
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor.set_data_from_numpy(x)
        out = client.infer("mlp", [tensor]).as_numpy("OUTPUT0")
        expected = export_examples.reference("mlp", x) if variant == "no actors" else np.zeros((1, 4))
        assert_close(out, expected)
        # perf_analyzer refuses a run whose statistics lack queue and execution counts.
        stats = client.get_inference_statistics("mlp").model_stats[0]
        assert (stats.inference_stats.success.count, stats.inference_stats.queue.count) == (1, 1)
        assert stats.execution_count == 1
        client.close()
    finally:
        server.terminate()
        server.wait(30)
