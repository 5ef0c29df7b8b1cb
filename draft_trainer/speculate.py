"""Speculative decoding on CPU: a transformers verifier and the EAGLE-3 draft, greedy, KV cache on both.

One round, with ``n`` committed tokens and the verifier's next token ``x_n`` known:

1. the draft chains ``k`` tokens: its first step reads (``x_n``, the verifier's aux states at ``n-1``)
   at position ``n-1``; step ``j`` reads (its previous token, its previous pre-norm state) at
   position ``n-1+j`` and attends to the committed step-0 entries plus its own chain entries;
2. the verifier scores ``[x_n, d_1..d_k]`` in one cached forward; the longest prefix of drafts equal
   to the verifier's greedy choices is accepted, plus one verifier token (so >= 1 token per round);
3. both caches are cropped to the committed prefix; the draft re-runs step 0 on the newly committed
   positions with the verifier's aux states (training's step 0 is exactly this).

Invariant: the output is the verifier's greedy output (every emitted token is a verifier argmax over
the committed prefix); acceptance only changes how many verifier forwards it takes.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3.core.layers import tap_module
from eagle3.draft_trainer.model import EagleDraft, attend


class VerifierTaps:
    """Forward hooks on a ``LlamaForCausalLM`` that keep the aux states (vLLM ids) of the last call.

    The server's hf backend taps the same modules (layer ``k``: ``embed_tokens`` for 0, decoder layer
    ``k-1`` otherwise; the final state: the last decoder layer's output, before the norm), so ``states``
    is what extraction stores, before the bf16 cast."""

    def __init__(self, model: Any, aux_layer_ids: tuple[int, ...]) -> None:
        self._states: dict[int, torch.Tensor] = {}
        self._hooks = []
        n_layers = len(model.model.layers)
        for slot, k in enumerate((*aux_layer_ids, n_layers)):  # the aux taps, then the final (pre-norm) state
            self._hooks.append(tap_module(model.model, k).register_forward_hook(self._hook(slot)))
        self.n_aux = len(aux_layer_ids)

    def _hook(self, slot: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            self._states[slot] = output[0] if isinstance(output, tuple) else output

        return hook

    def aux(self) -> torch.Tensor:
        """[T, n_aux*H] of the last forward (batch row 0)."""
        return torch.cat([self._states[s][0] for s in range(self.n_aux)], dim=-1)

    def states(self) -> torch.Tensor:
        """[T, n_aux + 1, H] of the last forward: the aux states, then the final pre-norm state."""
        return torch.stack([self._states[s][0] for s in range(self.n_aux + 1)], dim=1)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


@dataclass
class DraftCache:
    keys: torch.Tensor  # [S, nh, d]
    values: torch.Tensor  # [S, nh, d]

    @property
    def length(self) -> int:
        return int(self.keys.shape[0])

    def crop(self, length: int) -> None:
        self.keys, self.values = self.keys[:length], self.values[:length]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``EagleDraft.step``'s attention: append the ``m`` new rows' keys and values, then attend causally
        (row ``i`` of ``m`` sees the cache up to itself) -> [m, nh, d]."""
        m = q.shape[0]
        self.keys = torch.cat([self.keys, k])
        self.values = torch.cat([self.values, v])
        s = self.length
        mask = torch.arange(s)[None, :] <= (s - m + torch.arange(m))[:, None]  # [m, S]
        return attend(q, self.keys, self.values, mask)


def draft_step(
    draft: EagleDraft, cache: DraftCache, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int
) -> torch.Tensor:
    """``m`` new rows (tokens [m], hidden [m, H]) at positions ``start_pos..``, appended to ``cache``.

    Returns the pre-norm outputs [m, H]."""
    return draft.step(tokens, hidden, torch.arange(start_pos, start_pos + tokens.shape[0]), cache)


@dataclass
class GenerationStats:
    tokens: list[int]
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)  # drafts accepted per round
    seconds: float = 0.0


_CACHE_KWARG: dict[type, str] = {}  # model class -> its forward's name for the KV cache


def cache_kwarg(model: Any) -> str:
    """The name ``model.forward`` takes its KV cache under: ``cache`` from transformers 5.25 on (where
    ``past_key_values`` warns, to be removed in 5.40), ``past_key_values`` before."""
    cls = type(model)
    if cls not in _CACHE_KWARG:
        _CACHE_KWARG[cls] = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return _CACHE_KWARG[cls]


def _verifier_step(model: Any, ids: list[int], cache: Any) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids]), use_cache=True, **{cache_kwarg(model): cache})
    logits: torch.Tensor = out.logits[0]  # [m, V]
    return logits


def _crop(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of a transformers cache (negative crop: positive is deprecated)."""
    extra = int(cache.get_seq_length()) - length
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()
def greedy_generate(model: Any, prompt: list[int], max_new_tokens: int, eos_id: int | None) -> GenerationStats:
    """The verifier alone, one token per forward, with its KV cache (the baseline and the reference)."""
    from transformers import DynamicCache

    started = time.perf_counter()
    cache = DynamicCache()
    logits = _verifier_step(model, prompt, cache)
    out: list[int] = []
    while True:
        token = int(logits[-1].argmax())
        out.append(token)
        if len(out) >= max_new_tokens or token == eos_id:
            break
        logits = _verifier_step(model, [token], cache)
    return GenerationStats(out, rounds=len(out), seconds=time.perf_counter() - started)


@torch.inference_mode()
def speculative_generate(
    model: Any,
    draft: EagleDraft,
    taps: VerifierTaps,
    prompt: list[int],
    k: int,
    max_new_tokens: int,
    eos_id: int | None,
    step0_tokens: list[int] | None = None,
) -> GenerationStats:
    """Greedy speculative decoding with ``k`` chained draft tokens per round (see the module docstring).

    ``step0_tokens``, when given, receives the draft's step-0 token of every row it runs step 0 on, in
    row order (row ``i`` reads token ``i+1`` and predicts token ``i+2`` of prompt + output): the online
    counterpart of training's step-0 accuracy, per token."""
    from transformers import DynamicCache

    started = time.perf_counter()
    cache = DynamicCache()
    heads, head_dim = draft.cfg.num_attention_heads, draft.cfg.head_dim
    dcache = DraftCache(torch.zeros(0, heads, head_dim), torch.zeros(0, heads, head_dim))
    logits = _verifier_step(model, prompt, cache)  # [n, V]
    aux = taps.aux()  # [n, 3H]
    committed = list(prompt)
    next_token = int(logits[-1].argmax())
    out = [next_token]
    stats = GenerationStats(out)
    hidden = draft.project_aux(aux)  # [n, H] step-0 hidden of the rows not yet in the draft cache
    row_tokens = committed[1:] + [next_token]  # step-0 tokens of those rows
    while len(out) < max_new_tokens and next_token != eos_id:
        n = len(committed)
        rows_pre = draft_step(draft, dcache, torch.tensor(row_tokens), hidden, dcache.length)  # [m, H]
        if step0_tokens is not None:
            step0_tokens += draft.target_ids[draft.logits(rows_pre).argmax(-1)].tolist()
        pre = rows_pre[-1:]  # [1, H]
        drafts: list[int] = []
        for j in range(k):
            token = int(draft.target_ids[draft.logits(pre).argmax(-1)])
            drafts.append(token)
            if j + 1 < k:
                pre = draft_step(draft, dcache, torch.tensor([token]), draft.feedback(pre), n + j)  # [1, H]
        dcache.crop(n)
        logits = _verifier_step(model, [next_token, *drafts], cache)  # [k+1, V]
        choices = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == choices[accepted]:
            accepted += 1
        new = drafts[:accepted] + [int(choices[accepted])]
        _crop(cache, n + 1 + accepted)
        aux = taps.aux()[: accepted + 1]  # [a+1, 3H] rows of next_token and the accepted drafts
        committed += [next_token, *drafts[:accepted]]
        stats.rounds += 1
        stats.accepted.append(accepted)
        for token in new:
            out.append(token)
            if token == eos_id or len(out) >= max_new_tokens:
                break
        next_token = out[-1]
        hidden = draft.project_aux(aux)
        row_tokens = new
    stats.tokens = out[:max_new_tokens]
    stats.seconds = time.perf_counter() - started
    return stats
