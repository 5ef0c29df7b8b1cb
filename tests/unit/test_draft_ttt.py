"""TTT: no term sees the future, packing does not leak across samples, and the unrolled training
forward equals the chained inference forward (speculate.py) step for step."""

from __future__ import annotations

import pytest
import torch

from eagle3.draft_trainer.model import DraftConfig, EagleDraft
from eagle3.draft_trainer.speculate import DraftCache, draft_step
from eagle3.draft_trainer.ttt import PackedBatch, Teacher, simulated_acceptance, ttt_forward

H, V, VD, K = 32, 50, 40, 4


def _draft(seed: int = 0) -> tuple[EagleDraft, Teacher]:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, target_hidden_size=H, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, draft_vocab_size=VD, target_vocab_size=V,
                      aux_layer_ids=(1, 2, 3))  # fmt: skip
    draft = EagleDraft(cfg)
    ids = torch.arange(VD) + 5  # draft vocab = target ids 5..44
    d2t = ids - torch.arange(VD)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(d2t, t2d)
    draft.embed_tokens.copy_(torch.randn(V, H))
    teacher = Teacher(torch.ones(H), torch.randn(V, H), 1e-5)
    return draft, teacher


def _batch(lengths: list[int], seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    starts = torch.cat([torch.full((m,), sum(lengths[:i])) for i, m in enumerate(lengths)])
    return PackedBatch(
        input_ids=torch.randint(0, V, (n,), generator=g),
        aux=torch.randn(n, 3 * H, generator=g),
        final=torch.randn(n, H, generator=g),
        loss_mask=torch.ones(n, dtype=torch.bool),
        positions=torch.cat([torch.arange(m) for m in lengths]),
        seg_start=starts,
        seg_end=starts + torch.cat([torch.full((m,), m) for m in lengths]),
    )


def _terms(draft: EagleDraft, teacher: Teacher, batch: PackedBatch) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(ttt_forward(draft, teacher, batch, K).term_losses)  # [K, T]


def _replace(batch: PackedBatch, **changes: torch.Tensor) -> PackedBatch:
    return PackedBatch(**{**batch.__dict__, **changes})


def test_teacher_argmax_filter_keeps_terms() -> None:
    draft, teacher = _draft()
    result = ttt_forward(draft, teacher, _batch([20]), K)
    assert float(result.n_terms[0]) > 5  # the random teacher's argmax falls in the draft vocab often enough


@pytest.mark.parametrize("p", [3, 7, 12])
def test_future_features_change_no_earlier_term(p: int) -> None:
    draft, teacher = _draft()
    batch = _batch([16])
    base = _terms(draft, teacher, batch)
    aux = batch.aux.clone()
    aux[p:] += 5 * torch.randn_like(aux[p:])
    changed = _terms(draft, teacher, _replace(batch, aux=aux))
    assert torch.equal(base[:, :p], changed[:, :p])  # term (k, t) reads aux rows <= t only
    assert not torch.allclose(base[:, p:], changed[:, p:])


@pytest.mark.parametrize("q", [4, 9, 14])
def test_future_tokens_change_no_earlier_term(q: int) -> None:
    draft, teacher = _draft()
    batch = _batch([16])
    base = _terms(draft, teacher, batch)
    ids = batch.input_ids.clone()
    ids[q] = (ids[q] + 1) % V
    changed = _terms(draft, teacher, _replace(batch, input_ids=ids))
    for k in range(K):
        visible = slice(0, max(0, q - k - 1))  # term (k, t) reads tokens <= t + k + 1
        assert torch.equal(base[k, visible], changed[k, visible]), f"step {k} saw token {q}"
    assert not torch.equal(base, changed)


def test_future_teacher_states_change_no_earlier_term() -> None:
    draft, teacher = _draft()
    batch = _batch([16])
    base = _terms(draft, teacher, batch)
    final = batch.final.clone()
    final[10:] = torch.randn_like(final[10:])
    changed = _terms(draft, teacher, _replace(batch, final=final))
    for k in range(K):
        assert torch.equal(base[k, : 10 - k - 1], changed[k, : 10 - k - 1])  # teacher row of (k, t) is t + k + 1


def test_packing_does_not_leak_between_samples() -> None:
    draft, teacher = _draft()
    packed = _batch([11, 9, 14], seed=3)
    rows = {name: t[11:20] for name, t in packed.__dict__.items()}
    alone = PackedBatch(**dict(rows, seg_start=rows["seg_start"] - 11, seg_end=rows["seg_end"] - 11))
    torch.testing.assert_close(_terms(draft, teacher, packed)[:, 11:20], _terms(draft, teacher, alone))


def test_training_unroll_equals_chained_inference() -> None:
    """Step k of TTT at row t == the k-th chained draft of speculate.draft_step from the prefix rows <= t."""
    draft, teacher = _draft()
    batch = _batch([12], seed=1)
    t = 6
    with torch.no_grad():
        hidden = draft.project_aux(batch.aux)  # [T, H]
        prenorms = []
        result = ttt_forward(draft, teacher, batch, K)
        cache = DraftCache(torch.zeros(0, 4, 8), torch.zeros(0, 4, 8))
        pre = draft_step(draft, cache, batch.input_ids[1 : t + 2], hidden[: t + 1], 0)[-1:]  # rows 0..t
        prenorms.append(pre)
        for j in range(1, K):
            pre = draft_step(draft, cache, batch.input_ids[t + j + 1 : t + j + 2], pre, t + j)
            prenorms.append(pre)
        teacher_rows = [t + k + 1 for k in range(K)]
        full = teacher(batch.final[teacher_rows])[:, draft.target_ids].log_softmax(-1)  # [K, Vd]
        chained = torch.stack([
            -(full[k].exp() * draft.logits(prenorms[k])[0].log_softmax(-1)).sum() for k in range(K)
        ])  # fmt: skip
    trained = torch.stack([result.term_losses[k][t] for k in range(K)])
    counted = trained != 0
    assert counted.any()
    torch.testing.assert_close(trained[counted], chained[counted], rtol=1e-4, atol=1e-5)


def test_simulated_acceptance() -> None:
    assert simulated_acceptance([1.0, 1.0]) == 2.0
    assert simulated_acceptance([0.5, 0.5, 0.5]) == pytest.approx(0.5 + 0.25 + 0.125)
    assert simulated_acceptance([0.0, 1.0]) == 0.0
