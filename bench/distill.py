"""Distillation through the resident server against the in-process transformers loop, side by side.

    (a) in-process: ``bench.distill_inprocess.regenerate`` (its own load of the verifier included, fp32,
        left-padded batches of ``--batch`` prompts, transformers ``generate``);
    (b) through a server: an ``eagle3 serve --backend hf`` subprocess (started once, its load timed
        apart) and ``eagle3.client.distill.distill_dataset`` with ``--batch`` prompts per request.

Both on the same first ``--samples`` distinct prompts of the demo data, greedy, ``--new-tokens`` max.
Prints one JSON object: seconds and generated tokens/s of each, b/a, the server's load time, and how
many samples' replies are identical in (a) and (b) (fp32 both; a batch of the same prompts in the same
order is the same transformers call, so all of them should be).

    .venv/bin/python -m bench.distill                       # 64 prompts, 48 new tokens, batch 64
    .venv/bin/python -m bench.distill --samples 32 --batch 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.distill_inprocess import regenerate
from eagle3.client.distill import DistillConfig, distill_dataset
from eagle3.client.prepare import PrepareConfig, prepare_dataset
from eagle3.core.conversations import BUILTIN_CHATTERBOT
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir
from eagle3.core.protocol.prepared import PreparedSample, iter_prepared
from eagle3.local_server import LocalServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the server's")
    args = parser.parse_args()
    model_dir = resolve_model_dir(DEFAULT_MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_dataset(BUILTIN_CHATTERBOT, root / "prepared", model=DEFAULT_MODEL,
                        config=PrepareConfig(overwrite=True, progress=False))  # fmt: skip
        started = time.monotonic()
        regenerate(root / "prepared", root / "a", model_dir, max_samples=args.samples,
                   max_new_tokens=args.new_tokens, batch_size=args.batch)  # fmt: skip
        a_s = time.monotonic() - started
        a = {s.sample_id: s for s in iter_prepared(root / "a")}
        server_args = ["--model", str(model_dir), "--backend", "hf", "--dtype", args.dtype]
        with LocalServer(server_args, root / "server.log") as server:
            started = time.monotonic()
            server.wait_ready(timeout_s=600)
            load_s = time.monotonic() - started
            started = time.monotonic()
            config = DistillConfig(max_samples=args.samples, max_new_tokens=args.new_tokens,
                                   prompts_per_request=args.batch)  # fmt: skip
            summary = distill_dataset(root / "prepared", root / "b", server.url, config=config)
            b_s = time.monotonic() - started
        b = {s.sample_id: s for s in iter_prepared(root / "b")}

    def generated(samples: dict[str, PreparedSample]) -> int:
        return sum(s.n_assistant_tokens for s in samples.values())

    same = 0
    for sample_id, sa in a.items():
        sb = b.get(sample_id)  # (b) also supervises the template's newline after <|im_end|>: compare the reply
        if sb is not None and sb.input_ids[: sa.n_tokens] == sa.input_ids:
            same += 1
    print(json.dumps({
        "samples": len(a), "new_tokens_max": args.new_tokens, "batch": args.batch, "server_dtype": args.dtype,
        "in_process_s": round(a_s, 1), "in_process_tok_s": round(generated(a) / a_s, 1),
        "server_s": round(b_s, 1), "server_tok_s": round(summary.generated_tokens / b_s, 1),
        "server_over_in_process": round(a_s / b_s, 2), "server_load_s": round(load_s, 1),
        "identical_replies": same, "requests": summary.requests,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
