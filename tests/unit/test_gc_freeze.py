"""Only the process that exists to serve freezes the collector once the model is ready (``eagle3 serve``
passes ``freeze_gc_when_ready=True``); an app inside a longer-lived process (tests, embedding) does not,
or its frozen reference cycles, models included, would never be collected after the app is gone."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from eagle3.server import serve
from eagle3.server.app import create_app
from tests.unit.test_server_app import FakeBackend, settings, wait_for


def test_an_in_process_app_leaves_the_collector_alone(tmp_path: Path) -> None:
    before = gc.get_freeze_count()
    with TestClient(create_app(settings(), FakeBackend(tmp_path))) as c:
        wait_for(c, "ready")
        assert gc.get_freeze_count() == before


def test_the_serving_process_freezes_what_is_alive_once_ready(tmp_path: Path) -> None:
    gc.unfreeze()
    try:
        with TestClient(create_app(settings(), FakeBackend(tmp_path), freeze_gc_when_ready=True)) as c:
            wait_for(c, "ready")
            assert gc.get_freeze_count() > 10_000  # modules, the app, the runtime: everything alive then
    finally:
        gc.unfreeze()  # this test process outlives the app


def test_eagle3_serve_asks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, object]] = []

    class StopBeforeUvicornError(Exception):
        pass

    def fake_create_app(_settings: object, *args: object, **kwargs: object) -> None:
        seen.append(kwargs)
        raise StopBeforeUvicornError  # before uvicorn starts

    monkeypatch.setattr(serve, "create_app", fake_create_app)
    monkeypatch.setattr(serve, "configure_logging", lambda *_args: None)  # leave this process's logging be
    with pytest.raises(StopBeforeUvicornError):
        serve.serve(settings())
    assert seen == [{"freeze_gc_when_ready": True}]
