"""The hf backend's generate request in slices (``GenerationRun``, server/backends/base.py).

A request's prompts are left-padded into one batch (as transformers batches them) and continued by
transformers' own ``generate``, at most ``max_new_tokens`` new tokens per ``advance`` call. Between
slices the run keeps what the next slice needs to continue exactly where the last stopped: the
sequences so far, their attention mask, the KV cache (``DynamicCache``: the next slice feeds only
the last token) and the random generator's state (a seeded sampled request draws the same numbers
as in one call). So the replies equal one ``generate`` call over the whole request, token for token
(tests/integration/test_generate.py holds it), while the scheduler runs other work between slices
and drops the run when its client leaves. Rows that already stopped keep being fed (as they are in
one call); their reply is cut at its first stop token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from eagle3.core.protocol.generate import Sampling
from eagle3.server.backends.base import BackendError, Generation, cut_at_stop


class HfGenerationRun:
    def __init__(
        self, lm_model: Any, device: torch.device, prompts: Sequence[Sequence[int]], sampling: Sampling, after_call: Any
    ) -> None:
        from transformers import DynamicCache

        self.lm_model, self.device, self.sampling, self.after_call = lm_model, device, sampling, after_call
        self.stops = [int(t) for t in sampling.stop_token_ids or ()]
        self.pad_id = self.stops[0] if self.stops else 0
        self.width = max(len(p) for p in prompts)
        rows = [[self.pad_id] * (self.width - len(p)) + [int(t) for t in p] for p in prompts]
        self.ids = torch.tensor(rows, dtype=torch.long, device=device)  # [B, T so far]
        self.mask = torch.tensor([[0] * (self.width - len(p)) + [1] * len(p) for p in prompts], device=device)
        self.cache = DynamicCache()
        self.rng_state: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.cuda_devices = [torch.cuda.current_device()] if device.type == "cuda" else []

    @property
    def n_new(self) -> int:
        return int(self.ids.shape[1]) - self.width

    @property
    def generated_tokens(self) -> int:
        return sum(len(g.output_ids) for g in self._replies())

    def _replies(self) -> list[Generation]:
        return [
            cut_at_stop(row, self.stops, self.sampling.max_new_tokens) for row in self.ids[:, self.width :].tolist()
        ]

    def _finished(self) -> bool:
        if self.n_new >= self.sampling.max_new_tokens:
            return True
        return all(g.finish_reason == "stop" for g in self._replies())

    def advance(self, max_new_tokens: int) -> list[Generation] | None:
        from transformers import GenerationConfig

        sampling = self.sampling
        steps = max(1, min(max_new_tokens, sampling.max_new_tokens - self.n_new))
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=steps,
            do_sample=not sampling.greedy,
            temperature=sampling.temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            top_k=0 if not sampling.greedy else None,  # only temperature and top_p shape the distribution
            eos_token_id=self.stops or None,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
        )
        try:
            with torch.random.fork_rng(devices=self.cuda_devices):
                if self.rng_state is not None:
                    torch.set_rng_state(self.rng_state[0])
                    for device, state in zip(self.cuda_devices, self.rng_state[1], strict=True):
                        torch.cuda.set_rng_state(state, device)
                elif sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                out = self.lm_model.generate(
                    input_ids=self.ids,
                    attention_mask=self.mask,
                    past_key_values=self.cache,
                    generation_config=config,
                )
                self.rng_state = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.cuda_devices])
        except (RuntimeError, ValueError, IndexError) as exc:
            raise BackendError(f"generate failed: {exc}") from exc
        finally:
            self.after_call()
        new = out.sequences.shape[1] - self.ids.shape[1]
        self.ids = out.sequences
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], new))], dim=1)
        self.cache = out.past_key_values
        if new < steps or self._finished():  # transformers stopped early: every row hit a stop token
            return self._replies()
        return None
