"""The README's pipeline, copied line by line (issue 30): every line of its ``sh`` block under "## The
pipeline" runs as written, in order, in one directory, with only the placeholders a user replaces:

| README | here |
| --- | --- |
| ``/models/verifier`` | the embedded ``SmolLM2-135M-Instruct`` (real tokenizer and chat template) |
| ``chats.jsonl`` | 48 chatterbot dialogs written as ``{"messages": [...]}`` lines |
| ``http://gpu-node:8000`` / ``--port 8000`` | the server this test starts on a free port |
| ``--backend vllm`` | ``--backend hf --dtype float32`` (vLLM has its own end-to-end tests) |

Nothing else is changed: a README edit that breaks a line (a renamed flag, a missing argument, an output
a later line does not find) fails this test. The ``serve`` line runs in the background for the lines
after it; ``DATA=`` is a shell assignment the later lines read.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.core.conversations import iter_rows, parse_row
from tests.e2e.live_server import REPO_ROOT, LiveServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"


def readme_pipeline() -> list[str]:
    """The commands of the README's pipeline block, comments stripped."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## The pipeline") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "README.md: no sh block under '## The pipeline'"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def write_chats(path: Path, n: int) -> None:
    rows = []
    for raw in iter_rows("builtin:chatterbot"):
        conv = parse_row(raw.row or {}, raw.location)
        if len(conv.messages) >= 2:
            rows.append({"messages": [m.as_dict() for m in conv.messages[:2]]})
        if len(rows) == n:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def placeholders(line: str, url: str, port: int) -> str:
    line = line.replace("/models/verifier", MODEL).replace("http://gpu-node:8000", url)
    line = line.replace("--port 8000", f"--port {port}")
    return line.replace("--backend vllm", "--backend hf --dtype float32")


def test_the_readme_pipeline_runs_line_by_line(tmp_path: Path) -> None:
    pytest.importorskip("chatterbot_corpus")
    lines = readme_pipeline()
    assert lines[0].startswith("eagle3 serve "), lines[0]
    assert [line.split()[1] if line.startswith("eagle3") else line.split("=")[0] for line in lines] == [
        "serve", "prepare", "distill", "DATA", "vocab", "extract", "train", "export", "eval",
    ]  # fmt: skip
    write_chats(tmp_path / "chats.jsonl", 48)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    shell_vars: dict[str, str] = {}
    server = None
    try:
        for line in lines:
            if line.startswith("eagle3 serve "):
                args = shlex.split(placeholders(line, "", 0))[2:]
                port_at = args.index("--port")
                del args[port_at : port_at + 2]  # LiveServer picks a free port
                server = LiveServer(args, tmp_path / "serve.log")
                server.wait_ready(300)
                continue
            assert server is not None
            line = placeholders(line, server.url, server.port)
            assignment = re.fullmatch(r"([A-Z_]+)=(\S+)", line)
            if assignment:
                shell_vars[assignment.group(1)] = assignment.group(2)
                continue
            for name, value in shell_vars.items():
                line = line.replace(f"${name}", value)
            argv = shlex.split(line)
            done = subprocess.run(
                [sys.executable, "-m", "eagle3", *argv[1:]],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert done.returncode == 0, f"README line failed: {line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            if argv[1] == "eval":
                assert re.search(r"identical to greedy\s+yes", done.stdout), done.stdout  # the draft changed nothing
    finally:
        if server is not None:
            server.stop()
    data = Path(tmp_path / shell_vars["DATA"])
    assert (data / "samples.jsonl").is_file() and (data / "vocab-32000" / "vocab.safetensors").is_file()
    assert (tmp_path / "features" / "features.json").is_file()
    assert (tmp_path / "export" / "config.json").is_file() and (tmp_path / "export" / "model.safetensors").is_file()
