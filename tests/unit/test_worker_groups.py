"""``make test``'s xdist scheduling (tests/conftest.py): every vLLM engine test in one group, a file per group
otherwise, and the groups handed out longest first (a long group last leaves one worker alone at the end)."""

from __future__ import annotations

from tests.conftest import ENGINE_GROUP, GROUP_SECONDS, longest_first, worker_group


def test_engine_tests_share_one_group_and_other_files_their_own() -> None:
    assert worker_group("tests/integration/test_vllm_backend.py::test_x[a]") == ENGINE_GROUP
    assert worker_group("tests/e2e/test_chaos.py::test_vllm_server_sigkilled") == ENGINE_GROUP
    assert worker_group("tests/e2e/test_chaos.py::test_hf_server_sigkilled") == "tests/e2e/test_chaos.py"


def test_groups_go_out_longest_first_and_unknown_ones_keep_their_order() -> None:
    groups = ["tests/unit/test_b.py", "tests/e2e/test_readme_pipeline.py", "tests/unit/test_a.py", ENGINE_GROUP]
    assert longest_first(groups) == [ENGINE_GROUP, "tests/e2e/test_readme_pipeline.py", "tests/unit/test_b.py",
                                     "tests/unit/test_a.py"]  # fmt: skip
    assert all(GROUP_SECONDS[g] >= 20 for g in GROUP_SECONDS)  # the table lists the long groups only
