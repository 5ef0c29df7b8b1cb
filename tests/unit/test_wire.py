"""Typed wire meta (core/protocol/wire.py): the server's objects round-trip, and every malformed
field from a buggy server is a ProtocolError naming it (the SDK turns that into StreamError/APIError)."""

from __future__ import annotations

from typing import Any

import pytest

from eagle3.client.stream import StreamAssembler
from eagle3.core.protocol.frames import CODEC_NAMES, PROTOCOL_VERSION, Frame, FrameType, ProtocolError
from eagle3.core.protocol.wire import (
    CODECS,
    AbortMeta,
    DataMeta,
    EndMeta,
    ErrorInfo,
    SampleErrorMeta,
    ServerInfo,
    StreamHeader,
)

HEADER = StreamHeader("r1", "m", "rev", (2, 5, 7), 10, 64, 256, "sha", 2, 9, 1 << 20)


def test_round_trips() -> None:
    objects: list[Any] = [
        HEADER,
        DataMeta("a", 0, 0, 4, 4, True, 600),
        SampleErrorMeta("b", 1, ErrorInfo("invalid_sample", "bad", False)),
        AbortMeta(ErrorInfo("unavailable", "draining", True, reason="draining"), ("a",)),
        EndMeta(6, 1, 1, 4, 300, 600),
        ServerInfo(
            "m",
            "rev",
            "hf",
            "cpu",
            "bfloat16",
            10,
            (2, 5, 7),
            10,
            64,
            256,
            128,
            "sha",
            CODECS,
            "zstd+planes",
            {"max_batch_tokens": 8},
            url="http://x",
        ),  # fmt: skip
    ]
    for obj in objects:
        wire = obj.to_dict()
        assert type(obj).from_dict(wire) == (obj if not isinstance(obj, ServerInfo) else obj.__class__(**{
            **obj.__dict__, "url": ""}))  # fmt: skip
    assert "url" not in objects[-1].to_dict()  # local to the SDK, never sent
    assert HEADER.to_dict()["aux_layer_ids"] == [2, 5, 7] and HEADER.to_dict()["protocol"] == PROTOCOL_VERSION
    assert tuple(CODEC_NAMES) == CODECS


@pytest.mark.parametrize(
    ("cls", "change", "message"),
    [
        (StreamHeader, {"hidden_size": None}, "StreamHeader.hidden_size: expected an integer"),
        (StreamHeader, {"aux_layer_ids": "2,5"}, "StreamHeader.aux_layer_ids: expected a list"),
        (StreamHeader, {"aux_layer_ids": [2, "x"]}, r"aux_layer_ids\[1\]: expected an integer"),
        (StreamHeader, {"final_norm_applied": "no"}, "final_norm_applied: expected true/false"),
        (StreamHeader, {"request_id": ...}, "field 'request_id' is missing"),
        (StreamHeader, {"hidden_size": 0}, "zero hidden_size"),
        (DataMeta, {"raw_bytes": -1}, "raw_bytes is negative"),
        (DataMeta, {"final": 1}, "DataMeta.final: expected true/false"),
        (SampleErrorMeta, {"error": "boom"}, "SampleErrorMeta.error: ErrorInfo: expected a JSON object"),
        (AbortMeta, {"completed_sample_ids": [1]}, r"completed_sample_ids\[0\]: expected a string"),
        (EndMeta, {"n_samples": 2.5}, "EndMeta.n_samples: expected an integer"),
    ],
)
def test_malformed_fields_are_protocol_errors(cls: Any, change: dict[str, Any], message: str) -> None:
    good = {
        StreamHeader: HEADER.to_dict(),
        DataMeta: DataMeta("a", 0, 0, 4, 4, True, 600).to_dict(),
        SampleErrorMeta: SampleErrorMeta("b", 1, ErrorInfo("t", "m")).to_dict(),
        AbortMeta: AbortMeta(ErrorInfo("t", "m")).to_dict(),
        EndMeta: EndMeta(1, 0, 0, 0, 0, 0).to_dict(),
    }[cls]
    data = {k: v for k, v in {**good, **change}.items() if v is not ...}
    with pytest.raises(ProtocolError, match=message):
        cls.from_dict(data)
    with pytest.raises(ProtocolError, match="expected a JSON object"):
        cls.from_dict([1, 2])


def test_unknown_keys_are_ignored_for_forward_compatibility() -> None:
    assert StreamHeader.from_dict({**HEADER.to_dict(), "new_field": 1}) == HEADER


def test_end_counts_checked_against_what_arrived() -> None:
    asm = StreamAssembler("http://x", [{"id": "a", "input_ids": [1, 2]}])
    asm.handle(Frame(FrameType.HEADER, 0, HEADER.to_dict()))
    with pytest.raises(ProtocolError, match="END counts"):
        asm.handle(Frame(FrameType.END, 1, EndMeta(2, 1, 0, 2, 10, 10).to_dict()))
