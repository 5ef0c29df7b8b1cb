"""``eagle3 demo --eval-matrix 2`` (what ``make demo-full`` runs with 3,5,7): the whole demo at tiny sizes, then
τ on MT-Bench's first turns and on the held-out split at each k (one k here: speculative decoding is slow under
the suite's other worker), printed per cell and as the matrix (issue 32: the field's benchmark beside the
demo's own split). The matrix's cells are the per-cell runs' figures, every output equals the verifier's
greedy output, and the demo's status says so. ``--reply-tokens`` caps every distilled reply (the longer-replies
lever of docs/draft-quality.md; here shorter, which also keeps the test quick), and ``--eval-new-tokens`` the
tokens each eval prompt generates."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.core.protocol.prepared import iter_prepared

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_demo_prints_the_mt_bench_and_heldout_matrix(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "eagle3", "demo", "--out", str(out), "--samples", "24", "--epochs", "1",
           "--eval-prompts", "1", "--eval-matrix", "2", "--mt-bench-prompts", "1", "--reply-tokens", "12",
           "--eval-new-tokens", "16"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="2")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    # a reply (one supervised run) is at most its 12 new tokens plus the template's newline after the end token
    replies = [n for s in iter_prepared(out / "distilled") for n in supervised_runs(s.loss_mask)]
    assert len(replies) >= 24 and max(replies) <= 12 + 1, replies
    assert sum(n >= 12 for n in replies) >= 12, replies  # most chat replies run to the cap
    assert "tau matrix: 1 MT-Bench first turns and 1 held-out prompts at k=2" in text, text[-4000:]
    cells = {
        (name, int(k)): float(tau)
        for name, k, tau in re.findall(r"\[(mt-bench|heldout)\] k=(\d+): tau ([0-9.]+)", text)
    }
    assert set(cells) == {("mt-bench", 2), ("heldout", 2)}, text[-4000:]
    assert "identical False" not in text
    assert all(1.0 <= tau <= k + 1 for (_, k), tau in cells.items())
    matrix = text.split("tau (mean tokens per verifier step, engine eagle3)", 1)[1].splitlines()
    assert matrix[1].split() == ["k=2", "outside", "vocab"]  # the last column: the verifier's tokens not in it
    rows = {line.split()[0]: line.split()[1:] for line in matrix[2:4]}
    for name in ("mt-bench", "heldout"):
        assert float(rows[name][0]) == pytest.approx(cells[(name, 2)], abs=6e-4)
        assert rows[name][1].endswith("%") and 0.0 <= float(rows[name][1][:-1]) <= 100.0


def supervised_runs(loss_mask: list[int]) -> list[int]:
    """The lengths of the runs of 1s."""
    return [len(run) for run in "".join(map(str, loss_mask)).split("0") if run]
