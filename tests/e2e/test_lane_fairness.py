"""Issue 31 R1, live: closed-loop small-request clients beside a bulk tenant on a real ``eagle3 serve``.

The server runs the hf backend on a tiny random Llama (a real forward pass: a fixed cost per pass plus
a cost per token, like any engine). The bulk tenant keeps two requests of 16 x 64 tokens in flight
(like ``eagle3 extract``); first alone, then beside 2 and 16 closed-loop loops of one 8-token sample
each (the interactive lane) of a second tenant, each loop sending its next request as soon as it has
read the last. Two tenants share the server, so the bulk tenant's fair share is half of its backend time
(``eagle3_backend_seconds_total``): it must get at least 0.4 of it while both are active, and finish
within 8x its time alone. On 7e28fd2 the loops got every pass.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.live_server import LiveServer, tiny_llama_dir

pytestmark = pytest.mark.e2e
KEYS = {"bulk": "k-bulk", "chat": "k-chat"}
BULK_REQUESTS = 24  # of 16 samples x 64 tokens: 24 full passes of 1,024 tokens (start-up noise stays small)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("lane")
    model = tiny_llama_dir(root / "model", n_layers=8)
    args = [
        "--backend",
        "hf",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--max-batch-tokens",
        "1024",
        "--interactive-max-tokens",
        "64",
        "--cache-memory-mb",
        "0",
    ]
    with LiveServer(args, root / "server.log", api_keys=KEYS) as live:
        live.wait_ready(timeout_s=300)
        yield live


def extract(client: httpx.Client, server: LiveServer, tenant: str, samples: list[dict[str, Any]]) -> None:
    """One request as the SDK sends it: a retryable 503 (16 loops can fill the 16-deep validation queue,
    ``overloaded``) is retried after its Retry-After; anything else but 200 fails the test."""
    for _ in range(20):
        resp = client.post(f"{server.url}/v1/extract", json={"samples": samples}, headers=server.headers(tenant))
        if resp.status_code != 503 or resp.json()["error"].get("reason") != "overloaded":
            break
        time.sleep(float(resp.headers.get("Retry-After", "1")))
    assert resp.status_code == 200, resp.text[:500]
    assert resp.content  # the whole stream read, as a client does before its next request


def bulk_run(server: LiveServer, timeout_s: float) -> float:
    """Seconds for the bulk tenant's BULK_REQUESTS requests, two in flight."""
    todo = list(range(BULK_REQUESTS))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def loop() -> None:
        with httpx.Client(timeout=timeout_s) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    k = todo.pop()
                samples = [
                    {"id": f"b{k}-{i}", "input_ids": [(k * 97 + i * 13 + t) % 500 for t in range(64)]}
                    for i in range(16)
                ]
                try:
                    extract(client, server, "bulk", samples)
                except BaseException as exc:  # noqa: BLE001 (reported by the caller)
                    errors.append(exc)
                    return

    started = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    elapsed = time.monotonic() - started
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads), f"the bulk tenant did not finish in {timeout_s} s"
    return elapsed


def _chat_loops(url: str, headers: dict[str, str], loops: int, stop: Any, served: Any) -> None:
    """(a child process) ``loops`` closed-loop clients of one 8-token sample each: the clients are other
    processes, as users are, so their Python work does not share the bulk client's interpreter lock."""

    def chat_loop(j: int) -> None:
        with httpx.Client(timeout=60) as client:
            k = 0
            while not stop.is_set():
                sample = {"id": f"c{j}-{k}", "input_ids": [(j + k + t) % 500 for t in range(8)]}
                for _ in range(20):  # a retryable 503 overloaded is retried after Retry-After, as the SDK does
                    resp = client.post(f"{url}/v1/extract", json={"samples": [sample]}, headers=headers)
                    if resp.status_code != 503:
                        break
                    time.sleep(float(resp.headers.get("Retry-After", "1")))
                assert resp.status_code == 200, resp.text[:500]
                served[j] += 1
                k += 1

    threads = [threading.Thread(target=chat_loop, args=(j,)) for j in range(loops)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def backend_seconds(server: LiveServer) -> dict[str, float]:
    """Each tenant's backend time so far (``eagle3_backend_seconds_total``)."""
    m = server.metrics()
    return {t: m.get(f'eagle3_backend_seconds_total{{tenant="{t}"}}', 0.0) for t in KEYS}


@pytest.mark.parametrize("loops", [2, 16])
def test_closed_loop_small_requests_leave_the_bulk_tenant_its_share(server: LiveServer, loops: int) -> None:
    alone_s = bulk_run(server, timeout_s=120)
    ctx = multiprocessing.get_context("spawn")
    stop, served = ctx.Event(), ctx.Array("i", loops)
    chats = ctx.Process(target=_chat_loops, args=(server.url, server.headers("chat"), loops, stop, served))
    chats.start()
    time.sleep(2.0)  # the loops run alone first (their process started): the bulk tenant arrives into them
    try:
        before = backend_seconds(server)
        beside_s = bulk_run(server, timeout_s=max(60.0, 8 * alone_s))  # starved: it does not finish
        after = backend_seconds(server)
    finally:
        stop.set()
        chats.join(60)
        if chats.is_alive():
            chats.kill()
    used = {t: after[t] - before[t] for t in KEYS}
    share = used["bulk"] / sum(used.values())
    # two tenants: its fair share is half the backend time; at least 0.4 (measured 0.59 with 16 loops; 0.35
    # when a lane pass was charged only its tokens, not its share of a pass's fixed time: server/pass_cost.py).
    # The share, not the wall time: on a shared 2-core machine the client processes' own CPU slows every
    # forward pass (CI, charging tokens only: 1.7 s alone, 7.7 s beside 16 loops)
    assert share >= 0.4, (
        f"bulk got {share:.0%} of the backend time beside {loops} closed-loop loops "
        f"({used['bulk']:.2f} s vs {used['chat']:.2f} s; {beside_s:.1f} s beside, {alone_s:.1f} s alone)"
    )
    assert chats.exitcode == 0, "a small-request loop failed (its process's output above)"
    assert min(served[:]) > 0, "a small-request loop was starved instead"
