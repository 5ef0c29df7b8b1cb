"""The one request cut (``client/request_samples.py`` ``consecutive_runs``) behind ``split_requests`` (the
SDK), ``cut_batches`` (``extract_dataset``) and the distiller's chunks: order kept, every item once, each
run within the cap, an item over the cap alone; and the body-size limit as a token cap."""

from __future__ import annotations

import random

from eagle3.client.base_client import split_requests
from eagle3.client.request_samples import JSON_BYTES_PER_TOKEN, consecutive_runs, request_token_cap


def test_runs_keep_order_stay_under_the_cap_and_an_oversized_item_goes_alone() -> None:
    rng = random.Random(3)
    costs = [rng.randint(1, 40) for _ in range(300)] + [100, 5, 250, 1]
    runs = list(consecutive_runs(list(range(len(costs))), lambda i: costs[i], 50))
    assert [i for run in runs for i in run] == list(range(len(costs)))
    for run in runs:
        total = sum(costs[i] for i in run)
        assert total <= 50 or len(run) == 1, (run, total)
    for a, b in zip(runs, runs[1:], strict=False):  # greedy: the next item did not fit the run before it
        assert sum(costs[i] for i in a) + costs[b[0]] > 50
    assert [100] in [[costs[i] for i in run] for run in runs] and [250] in [[costs[i] for i in run] for run in runs]
    assert list(consecutive_runs([], len, 10)) == []


def test_the_body_limit_is_a_token_cap_and_split_requests_uses_the_smaller() -> None:
    assert request_token_cap(1000, 10_000) == 10_000 // JSON_BYTES_PER_TOKEN
    assert request_token_cap(500, 10_000) == 500
    requests = [{"id": str(i), "input_ids": [7] * 300} for i in range(7)]
    by_body = list(split_requests(requests, (10_000, 700 * JSON_BYTES_PER_TOKEN)))  # the body limit binds
    assert [len(batch) for batch in by_body] == [2, 2, 2, 1]
    by_tokens = list(split_requests(requests, (900, 1 << 30)))  # the token limit binds
    assert [len(batch) for batch in by_tokens] == [3, 3, 1]
