"""What one speculative round costs, in verifier decode forwards: prints JSON.

    python -m bench.round_cost [--device cpu|cuda] [--shape smollm2|llama8b] [--model DIR] [--reps 7]

Times, side by side with a KV cache of ``--context`` tokens: the verifier's forward of 1 new token, of
``k + 1`` new tokens (the verification of k drafts), and a draft step (a one-layer Llama of the same
width, draft vocabulary; the EAGLE-3 layer is this plus ``fc`` and a 2H-wide attention input). Medians
of ``--reps`` interleaved repetitions. speedup ≈ τ / round_cost_in_forwards, round_cost = (verify(k+1)
+ k * draft_step) / verify(1). Random weights (timing does not depend on them) unless ``--model``.
On CPU the 135M verifier is compute-bound (verify(k+1) ≈ k+1 forwards); on a GPU decoding is
memory-bound (verify(k+1) ≈ 1 forward): that is why a CPU speedup says little about a GPU one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab, draft vocab
    "smollm2": (576, 30, 9, 3, 1536, 49152, 8192),
    "llama8b": (4096, 32, 32, 8, 14336, 128256, 32000),
}


def _config(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                       max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def forward_ms(model: Any, n_new: int, context: int, iters: int, device: str) -> float:
    """Mean ms of a cached forward of ``n_new`` tokens after ``context`` (the cache cropped back each time)."""
    from transformers import DynamicCache

    from eagle3.draft_trainer.speculate import cache_kwarg

    cache = DynamicCache()
    kv = {cache_kwarg(model): cache}  # `cache` from transformers 5.25 on, `past_key_values` before
    model(input_ids=torch.randint(0, 1000, (1, context), device=device), use_cache=True, **kv)
    new = torch.randint(0, 1000, (1, n_new), device=device)
    for i in range(iters + 3):
        if i == 3:
            _sync(device)
            started = time.perf_counter()
        model(input_ids=new, use_cache=True, **kv)
        cache.crop(-n_new)
    _sync(device)
    return (time.perf_counter() - started) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--model", help="a verifier checkpoint directory instead of random weights of --shape")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    hidden, layers, heads, kv, inter, vocab, draft_vocab = SHAPES[args.shape]
    torch.set_default_dtype(dtype)
    with torch.device(args.device):
        if args.model:
            verifier = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
        else:
            verifier = LlamaForCausalLM(_config(hidden, layers, heads, kv, inter, vocab)).eval()
        draft = LlamaForCausalLM(_config(hidden, 1, heads, kv, inter, draft_vocab)).eval()
    runs: dict[str, list[float]] = {"verify_1_ms": [], f"verify_{args.k + 1}_ms": [], "draft_step_ms": []}
    for rep in range(args.reps + 1):  # the first repetition warms up
        times = [forward_ms(verifier, 1, args.context, args.iters, args.device),
                 forward_ms(verifier, args.k + 1, args.context, args.iters, args.device),
                 forward_ms(draft, 1, args.context, args.iters, args.device)]  # fmt: skip
        if rep:
            for key, value in zip(runs, times, strict=True):
                runs[key].append(value)
    med = {key: statistics.median(values) for key, values in runs.items()}
    one, verify, step = med["verify_1_ms"], med[f"verify_{args.k + 1}_ms"], med["draft_step_ms"]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(json.dumps({
        "device": device_name, "threads": args.threads, "dtype": str(dtype), "shape": args.model or args.shape,
        "k": args.k, "context": args.context, "reps": args.reps, **med,
        f"verify_{args.k + 1}_over_1": verify / one, "draft_step_over_1": step / one,
        "round_cost_in_forwards": (verify + args.k * step) / one,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
