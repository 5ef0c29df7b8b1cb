"""Generation without a model: the wire types' validation, the scheduler's handling of a generate unit
(packed with extraction, charged by tokens generated), and the distill client's turn splitting and
torn-line recovery."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from eagle3.client.distill import DistillConfig, Turns, after_end_of_turn, read_partial
from eagle3.client.errors import InvalidSampleError
from eagle3.client.generate import generate_request
from eagle3.core.protocol.frames import ProtocolError
from eagle3.core.protocol.generate import GeneratedReply, GenerateRequest, GenerateResponse, Sampling
from eagle3.core.protocol.prepared import PreparedFormatError, PreparedSample
from eagle3.server.backends.base import Generation, cut_at_stop
from eagle3.server.generation import GenerateUnit, GenerateWork
from eagle3.server.scheduler import Scheduler
from eagle3.server.units import Sample


def test_request_parse_checks_every_field() -> None:
    req = GenerateRequest.parse({"prompts": [{"id": "a", "input_ids": [1, 2]},
                                             {"id": "b", "messages": [{"role": "user", "content": "hi"}]}],
                                 "max_new_tokens": 8, "temperature": 0.7, "seed": 3})  # fmt: skip
    assert req.sampling == Sampling(8, 0.7, 1.0, 3, None) and not req.sampling.greedy
    assert req.prompts[1].messages is not None and req.prompts[1].messages[0].content == "hi"
    assert GenerateRequest.parse(req.to_dict()) == req
    cases: dict[str, dict[str, Any]] = {
        "did you mean 'max_new_tokens'": {"max_tokens": 4},
        r"GenerateRequest\.prompts\[0\]\.idd: unknown field": {"prompts": [{"idd": "a", "input_ids": [1]}]},
        "exactly one of input_ids or messages": {"prompts": [{"id": "a"}]},
        "input_ids is empty": {"prompts": [{"id": "a", "input_ids": []}]},
        "appears more than once": {"prompts": [{"id": "a", "input_ids": [1]}, {"id": "a", "input_ids": [2]}]},
        "prompts is empty": {"prompts": []},
        r"max_new_tokens must be in \[1, ": {"max_new_tokens": 0},
        r"top_p must be in \(0, 1\]": {"top_p": 0},
        r"temperature must be in \[0, 100\]": {"temperature": float("nan")},
        "expected an integer": {"prompts": [{"id": "a", "input_ids": [1, "2"]}]},
        "seed must be in": {"seed": -1},
        "sample id is empty": {"prompts": [{"id": "", "input_ids": [1]}]},
    }
    for message, change in cases.items():
        body: dict[str, Any] = {"prompts": [{"id": "a", "input_ids": [1]}]}
        body.update(change)
        with pytest.raises(ProtocolError, match=message):
            GenerateRequest.parse(body)


def test_sdk_request_shapes_and_errors() -> None:
    req = generate_request([[1, 2], [{"role": "user", "content": "x"}], {"id": "z", "input_ids": (3,)}])
    assert [p.id for p in req.prompts] == ["0", "1", "z"] and req.prompts[2].input_ids == (3,)
    with pytest.raises(InvalidSampleError, match="unique"):
        generate_request([{"id": "a", "input_ids": [1]}, {"id": "a", "input_ids": [1]}])
    with pytest.raises(InvalidSampleError, match="prompt ids"):
        generate_request([PreparedSample("s", [1, 2], [0, 1])])


def test_response_round_trip_and_reply_check() -> None:
    resp = GenerateResponse("r", "m", "rev", "hf", "sha", (GeneratedReply("a", 3, (5, 2), "stop"),),
                            Sampling(stop_token_ids=(2,)), 3, 2)  # fmt: skip
    assert GenerateResponse.from_dict(resp.to_dict()) == resp
    with pytest.raises(ProtocolError, match="finish_reason"):
        GeneratedReply("a", 3, (5,), "eos")


def test_cut_at_stop() -> None:
    assert cut_at_stop([5, 6, 2, 7], (2,), 10) == Generation([5, 6, 2], "stop")
    assert cut_at_stop([5, 6, 7], (2,), 2) == Generation([5, 6], "length")
    assert cut_at_stop([5, 2], (), 10) == Generation([5, 2], "length")


class Fake:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def extract(self, batch: Sequence[Sequence[int]]) -> list[Any]:
        self.calls.append(f"extract x{len(batch)}")
        return [list(ids) for ids in batch]

    def generate(self, work: GenerateWork) -> list[Generation]:
        self.calls.append(f"generate x{len(work.prompts)}")
        return [Generation([7] * 3 + [2], "stop") for _ in work.prompts]  # 4 of the 10 allowed


def test_a_generate_unit_is_charged_what_it_generated() -> None:
    fake = Fake()
    sched = Scheduler(fake.extract, generate=fake.generate, max_batch_tokens=100, max_inflight_tokens=1000,
                      max_tenant_inflight_tokens=1000)  # fmt: skip

    async def run() -> None:
        work = GenerateWork(("p", "q"), ((1, 2, 3), (4, 5)), Sampling(max_new_tokens=10, stop_token_ids=(2,)))
        assert work.n_tokens == 5 + 2 * 10
        gen = sched.submit("g", "alice", [GenerateUnit(0, "g", work)])
        ext = sched.submit("e", "bob", [Sample(0, "e", [9] * 6, [0] * 6)])
        assert sched.tenant_inflight == {"alice": 25, "bob": 6}
        sched.start()
        for req in (gen, ext):
            results: list[Any] = []
            while not results:
                results = await req.next_results(5.0)
            sched.consumed(req, results[0])
            sched.close(req)
            if req is gen:
                assert results[0].error is None and [g.output_ids for g in results[0].states] == [[7, 7, 7, 2]] * 2
        assert fake.calls == ["extract x1", "generate x2"]  # one pass: extraction first, then the unit
        assert sched.fair.served["alice"] == 5 + 8 and sched.fair.served["bob"] == 6  # prompts + generated, not 25
        assert sched.metrics.get("eagle3_tokens_generated_total", tenant="alice") == 8
        assert sched.inflight_tokens == 0 and sched.tenant_inflight == {}

    try:
        asyncio.run(run())
    finally:
        sched.stop(timeout_s=5)


def test_a_failing_generate_is_the_requests_error() -> None:
    def boom(_work: Any) -> Any:
        raise RuntimeError("engine lost")

    sched = Scheduler(lambda b: list(b), generate=boom, max_batch_tokens=100, max_inflight_tokens=1000,
                      max_tenant_inflight_tokens=1000)  # fmt: skip

    async def run() -> None:
        work = GenerateWork(("p",), ((1,),), Sampling(max_new_tokens=4))
        req = sched.submit("g", "t", [GenerateUnit(0, "g", work)])
        sched.start()
        deadline = time.monotonic() + 5
        results: list[Any] = []
        while not results and time.monotonic() < deadline:
            results = await req.next_results(1.0)
        sched.close(req)
        assert results[0].error["type"] == "backend_error" and "engine lost" in results[0].error["message"]

    try:
        asyncio.run(run())
    finally:
        sched.stop(timeout_s=5)


def test_turns_split_by_mask_runs() -> None:
    sample = PreparedSample("s", [1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 1, 1, 0, 1, 1, 1, 0])
    turns = Turns.of(sample)
    assert turns.prompts == [[1, 2], [5]] and turns.replies == [[3, 4], [6, 7, 8]]  # a trailing prompt is dropped
    assert Turns.of(PreparedSample("t", [1, 2, 3], [1, 0, 1])).prompts == [[], [2]]
    assert after_end_of_turn([10, 11, 2, 198], (2,)) == [198] and after_end_of_turn([10, 11], (2,)) == []


def test_read_partial_cuts_only_a_torn_last_line(tmp_path: Path) -> None:
    good = [PreparedSample(f"s{i}", [1, 2], [0, 1]) for i in range(3)]
    path = tmp_path / "samples.jsonl.partial"
    text = "".join(s.to_json() + "\n" for s in good)
    path.write_text(text + '{"id": "s3", "input_ids": [1')
    assert read_partial(path) == good and path.read_text() == text
    path.write_text("garbage\n" + text)
    with pytest.raises(PreparedFormatError, match="damaged"):
        read_partial(path)


def test_sampled_replies_ids_and_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """``--sampled-replies N``: a prompt's replies are its main one then ``~s1..~sN``; a negative N or a zero
    temperature is a usage error naming the flag; the parsed flags reach ``DistillConfig``."""
    from eagle3.cli import build_parser

    turns = Turns("a", [[1]], [[2]])
    assert DistillConfig(sampled_replies=2).reply_ids(turns) == ["a-distill", "a-distill~s1", "a-distill~s2"]
    assert DistillConfig().reply_ids(turns) == ["a-distill"]
    assert "sampled_replies" not in DistillConfig().identity()  # runs started before the flag resume unchanged
    parser = build_parser()
    args = parser.parse_args(["distill", "p", "--out", "o", "--sampled-replies", "3", "--sampled-temperature", "0.7"])
    assert (args.sampled_replies, args.sampled_temperature) == (3, 0.7)
    for bad, flag in (
        (["--sampled-replies", "-1"], "--sampled-replies"),
        (["--sampled-temperature", "0"], "--sampled-temperature"),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["distill", "p", "--out", "o", *bad])
        assert flag in capsys.readouterr().err


def test_reply_text_is_optional_both_ways() -> None:
    """A server older than ``text`` sends none (the reply's text is None); an older client ignores it."""
    old = {"id": "a", "prompt_tokens": 2, "output_ids": [5, 2], "finish_reason": "stop"}
    assert GeneratedReply.from_dict(old).text is None
    new = GeneratedReply("a", 2, (5, 2), "stop", "Hi")
    assert new.to_dict()["text"] == "Hi" and GeneratedReply.from_dict(new.to_dict()) == new
