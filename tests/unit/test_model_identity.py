"""One model identity (core/protocol/model_identity.py), compared the same way everywhere.

For every field of ``ModelIdentity`` (read from the dataclass, so a field added there is covered here
without editing this file): each object that carries an identity carries that field; and a
difference in that field alone is refused, with the field named, by the features directory (resume),
by the stream's HEADER check against ``/v1/info``, and by ``extract_dataset``'s check of each server
against the extraction's identity.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle3.client.errors import IncompatibleError
from eagle3.client.extract import ExtractConfig, extract_dataset
from eagle3.client.sdk import ExtractionClient
from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.protocol.features import FeaturesMeta
from eagle3.core.protocol.model_identity import ModelIdentity
from eagle3.core.protocol.wire import ServerInfo, StreamHeader
from eagle3.server.backends.base import BackendInfo
from eagle3.server.stream import stream_header
from tests.unit.sdk_fake import FakeServer
from tests.unit.test_sdk_extract import make_prepared

FIELDS = [f.name for f in dataclasses.fields(ModelIdentity)]
BASE = ModelIdentity.of(ServerInfo.from_dict(FakeServer().info))  # the fake server's model


def other_value(value: Any) -> Any:
    """A different value of the same type (a new field of a new type must teach this function)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, tuple):
        return (*value, max(value) + 1)
    raise AssertionError(f"no other value for {value!r}: add its type to other_value")


def changed(name: str) -> ModelIdentity:
    return dataclasses.replace(BASE, **{name: other_value(getattr(BASE, name))})


def info_with(identity: ModelIdentity) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(json.dumps({**FakeServer().info, **identity.as_fields()}))
    return info


def test_every_carrier_holds_every_field() -> None:
    for carrier in (ServerInfo, StreamHeader, FeaturesMeta):
        names = {f.name for f in dataclasses.fields(carrier)}
        assert set(FIELDS) <= names, f"{carrier.__name__} lacks {set(FIELDS) - names}"
    backend = BackendInfo(
        BASE.model_id,
        BASE.revision,
        "/m",
        BASE.final_layer_id,
        BASE.hidden_size,
        BASE.vocab_size,
        4096,
        "bfloat16",
        BASE.aux_layer_ids,
        BASE.tokenizer_sha256,
        "hf",
        "cpu",
    )
    assert backend.identity == BASE
    assert stream_header(backend, "r", 1, 1, 1 << 20).identity == BASE  # the server's HEADER: the same identity
    assert ModelIdentity.of(FeaturesMeta(**BASE.as_fields(), dtype="bfloat16")) == BASE


@pytest.mark.parametrize("name", FIELDS)
def test_diff_names_exactly_the_differing_field(name: str) -> None:
    assert BASE.diff(BASE) == ""
    assert BASE.diff(changed(name)).split(":")[0] == name


@pytest.mark.parametrize("name", FIELDS)
def test_a_features_directory_refuses_another_model(tmp_path: Path, name: str) -> None:
    FeaturesWriter.open(tmp_path, FeaturesMeta(**BASE.as_fields(), dtype="bfloat16")).close()
    with pytest.raises(IncompatibleError, match=f"{name}: "):
        FeaturesWriter.open(tmp_path, FeaturesMeta(**changed(name).as_fields(), dtype="bfloat16"))


@pytest.mark.parametrize("name", FIELDS)
def test_a_stream_header_must_describe_what_v1_info_said(name: str) -> None:
    fake = FakeServer()  # its HEADER describes BASE; its /v1/info now another model
    fake.info = info_with(changed(name))
    with ExtractionClient("http://a", transport=fake.transport(), max_retries=0) as client:
        client.info()
        with pytest.raises(IncompatibleError, match=f"HEADER differs .*{name}: "):
            list(client.extract_stream([{"id": "a", "input_ids": [1, 2, 3]}]))


@pytest.mark.parametrize("name", FIELDS)
def test_extract_refuses_a_server_of_another_model(tmp_path: Path, name: str) -> None:
    make_prepared(tmp_path / "prep")
    first, other = FakeServer(), FakeServer()
    other.info = info_with(changed(name))

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a" and request.url.path == "/v1/extract":
            raise httpx.ConnectError("refused", request=request)  # so the other server must take batches
        return (first if request.url.host == "a" else other).handle(request)

    config = ExtractConfig(progress=False, requests_per_server=1, max_retries=50)
    with pytest.raises(IncompatibleError, match=f"http://b serves another model .*{name}: "):
        extract_dataset(
            tmp_path / "prep",
            tmp_path / "out",
            ["http://a", "http://b"],
            config=config,
            transport=httpx.MockTransport(handle),
            sleep=lambda s: None,
        )
