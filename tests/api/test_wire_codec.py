"""The gRPC codec's answers: a plain message (RepositoryIndex, metadata, readiness) is written by
upb through its mirror, and must be the very bytes betterproto2 writes; any other goes through
betterproto2 itself."""

from __future__ import annotations

import betterproto2
import pytest

from hloserve._proto import inference as kserve
from hloserve.api.wire_codec import KnownFieldsCodec, _plain

Entry = kserve.RepositoryIndexResponseModelIndex

_INDEX = kserve.RepositoryIndexResponse(
    models=[
        Entry(name="cnn", version="1", state="READY"),
        Entry(name="ünïcode-模型", version="1", state="UNAVAILABLE", reason="unloaded"),
        Entry(),  # every field at its default: an empty entry
    ]
)
_METADATA = kserve.ModelMetadataResponse(
    name="mlp",
    versions=["1", "2"],
    platform="hloserve",
    inputs=[kserve.ModelMetadataResponseTensorMetadata(name="INPUT0", datatype="FP32", shape=[-1, 16])],
    outputs=[kserve.ModelMetadataResponseTensorMetadata(name="OUTPUT0", datatype="FP32", shape=[-1, 2**40])],
)
PLAIN = {
    "index": _INDEX,
    "empty index": kserve.RepositoryIndexResponse(),
    "metadata": _METADATA,
    "server metadata": kserve.ServerMetadataResponse(name="hloserve", version="0.1.0", extensions=["a", "b"]),
    "ready": kserve.ServerReadyResponse(ready=True),
    "not ready": kserve.ModelReadyResponse(ready=False),
    "duration": kserve.StatisticDuration(count=2**63 - 1, ns=0),
    "shm status": kserve.SystemSharedMemoryStatusResponseRegionStatus(
        name="r", key="/k", offset=8, byte_size=2**33
    ),
}


@pytest.mark.parametrize("message", PLAIN.values(), ids=PLAIN.keys())
def test_a_plain_answer_is_the_bytes_betterproto2_writes(message: betterproto2.Message) -> None:
    assert _plain(type(message))
    encoded = KnownFieldsCodec().encode(message, type(message))
    assert encoded == bytes(message)
    assert type(message).parse(encoded) == message


@pytest.mark.parametrize(
    "message",
    [
        kserve.ModelStatisticsResponse(model_stats=[kserve.ModelStatistics(name="mlp", inference_count=3)]),
        kserve.ModelConfigResponse(config=kserve.ModelConfig(name="mlp", max_batch_size=8)),
        kserve.TraceSettingResponse(
            settings={"trace_level": kserve.TraceSettingResponseSettingValue(value=["OFF"])}
        ),
    ],
    ids=["statistics (singular messages)", "config (singular message)", "trace settings (a map)"],
)
def test_any_other_answer_goes_through_betterproto2(message: betterproto2.Message) -> None:
    assert not _plain(type(message))
    assert KnownFieldsCodec().encode(message, type(message)) == bytes(message)


def test_a_message_of_another_type_is_refused_as_grpclib_refuses_it() -> None:
    with pytest.raises(TypeError, match="Message must be of type"):
        KnownFieldsCodec().encode(kserve.ServerReadyResponse(ready=True), kserve.ModelReadyResponse)
