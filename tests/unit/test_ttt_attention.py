"""The linear-memory TTT attention equals the dense [nh, T, T] form it replaced (forward and gradients).

The reference is ``dense_ttt_attention`` (the pre-blockwise code, verbatim). Random packed batches of
several samples (lengths 1..60, one of length 1), K = 1..7 chain steps, fp32, <= 1e-5 relative error.
A tiny scratch budget forces many query blocks, several crossing sample boundaries."""

from __future__ import annotations

import pytest
import torch

from eagle3.draft_trainer import ttt_loss
from eagle3.draft_trainer.ttt import ttt_forward
from eagle3.draft_trainer.ttt_attention import SampleLayout, dense_ttt_attention, resolve_implementation, ttt_attention
from tests.unit.test_draft_ttt import _batch, _draft

NH, D = 4, 8
LENGTHS = [13, 1, 60, 7, 29, 2]


def _seg_start(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((m,), sum(lengths[:i])) for i, m in enumerate(lengths)])


def _inputs(k: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    q = torch.randn(n, NH, D, generator=g).requires_grad_()
    keys = [(2 * torch.randn(n, NH, D, generator=g)).requires_grad_() for _ in range(k)]
    values = [torch.randn(n, NH, D, generator=g).requires_grad_() for _ in range(k)]
    return q, keys, values, torch.randn(n, NH, D, generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


@pytest.mark.parametrize("scratch", [NH * 40, 1 << 24])  # many small blocks / one block
def test_blockwise_equals_dense_forward_and_gradients(scratch: int) -> None:
    seg = _seg_start(LENGTHS)
    layout = SampleLayout.build(seg, NH, scratch_elements=scratch)
    if scratch < 1 << 24:
        assert len(layout.blocks) > len(LENGTHS)  # blocks split samples and span boundaries
    for k in range(1, 8):
        q, keys, values, grad_out = _inputs(k, seed=k)
        ref = dense_ttt_attention(q, keys, values, seg)
        ref_grads = torch.autograd.grad((ref * grad_out).sum(), [q, *keys, *values])
        out = ttt_attention(q, keys, values, layout, "blockwise")
        grads = torch.autograd.grad((out * grad_out).sum(), [q, *keys, *values])
        assert _rel(out, ref) <= 1e-5, f"K={k} forward"
        for i, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
            assert _rel(got, want) <= 1e-5, f"K={k} gradient {i}"


def test_flex_path_equals_dense_forward() -> None:
    """The CUDA path's block mask and LSE merge, run eagerly on CPU (flex has no CPU backward)."""
    seg = _seg_start(LENGTHS)
    layout = SampleLayout.build(seg, NH)
    with torch.no_grad():
        for k in (1, 4, 7):
            q, keys, values, _ = _inputs(k, seed=10 + k)
            ref = dense_ttt_attention(q, keys, values, seg)
            assert _rel(ttt_attention(q, keys, values, layout, "flex"), ref) <= 1e-5, f"K={k}"


def test_blocks_cover_every_row_within_the_scratch() -> None:
    seg = _seg_start(LENGTHS)
    layout = SampleLayout.build(seg, NH, scratch_elements=NH * 100)
    covered = [row for a, b, _ in layout.blocks for row in range(a, b)]
    assert covered == list(range(sum(LENGTHS)))
    for a, b, lo in layout.blocks:
        assert lo == int(seg[a]) and (b - a == 1 or NH * (b - a) * (b - lo) <= NH * 100)


def test_unknown_implementation_is_named() -> None:
    assert resolve_implementation("auto", torch.device("cpu")) == "blockwise"
    with pytest.raises(ValueError, match="'sparse'"):
        resolve_implementation("sparse", torch.device("cpu"))


def test_ttt_forward_blockwise_and_chunked_equals_dense_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole TTT loss: blockwise attention + 3-row loss chunks (checkpointed) == dense + one chunk."""
    draft, teacher = _draft()
    batch = _batch([11, 1, 17, 9], seed=5)
    params = [p for p in draft.parameters() if p.requires_grad]
    dense = ttt_forward(draft, teacher, batch, 7, attention="dense")
    dense_grads = torch.autograd.grad(dense.loss, params)
    monkeypatch.setattr(ttt_loss, "LOSS_CHUNK_ELEMENTS", 3 * 40)  # 3 rows of the 40-id draft vocab
    monkeypatch.setattr(ttt_loss, "KEEP_LOSS_ELEMENTS", 0)  # every chunk checkpointed
    chunked = ttt_forward(draft, teacher, batch, 7, attention="blockwise")
    grads = torch.autograd.grad(chunked.loss, params)
    assert _rel(chunked.loss, dense.loss) <= 1e-5
    assert torch.equal(chunked.correct, dense.correct) and torch.equal(chunked.n_terms, dense.n_terms)
    torch.testing.assert_close(torch.stack(chunked.term_losses), torch.stack(dense.term_losses), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, dense_grads, strict=True):
        assert _rel(got, want) <= 1e-5


def test_checkpointed_loss_chunks_keep_no_vocab_sized_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each checkpointed loss chunk gets the micro-batch's whole teacher tensor and its rows, never a gathered
    [c, Vd] copy: a checkpoint keeps its arguments until backward, so gathered copies added up to K x T x Vd
    fp32 (3.7 GB at 4,096 tokens, Vd 32,000: bench/train.py measured 5.9 GB of step peak there)."""
    draft, teacher = _draft()
    batch = _batch([11, 1, 17, 9], seed=5)
    seen: list[tuple[int, tuple[int, ...]]] = []
    real_chunk = ttt_loss._chunk

    def recording_chunk(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        teacher_logp = args[2]
        seen.append((teacher_logp.untyped_storage().data_ptr(), tuple(teacher_logp.shape)))
        return real_chunk(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ttt_loss, "_chunk", recording_chunk)
    monkeypatch.setattr(ttt_loss, "LOSS_CHUNK_ELEMENTS", 3 * 40)  # 3 rows of the 40-id draft vocab
    monkeypatch.setattr(ttt_loss, "KEEP_LOSS_ELEMENTS", 0)  # every chunk checkpointed
    out = ttt_forward(draft, teacher, batch, 7, attention="blockwise")
    n_rows = sum([11, 1, 17, 9])
    assert len(seen) > 7, "several chunks per step ran"
    assert {shape for _, shape in seen} == {(n_rows, 40)}, "a chunk got a gathered copy instead of the whole tensor"
    assert len({ptr for ptr, _ in seen}) == 1, "every chunk of every step shares one teacher tensor"
    out.loss.backward()  # the recomputation in backward gets the same arguments
    assert {shape for _, shape in seen} == {(n_rows, 40)}


def test_small_steps_keep_their_loss_activations_and_equal_the_checkpointed_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step of at most KEEP_LOSS_ELEMENTS (rows x Vd) runs as one chunk without the checkpoint (no head
    recomputation in backward); loss, hits and gradients equal the checkpointed chunks'. Above it, checkpoints."""
    draft, teacher = _draft()
    batch = _batch([11, 1, 17, 9], seed=5)
    params = [p for p in draft.parameters() if p.requires_grad]
    calls: list[int] = []
    real_checkpoint = torch.utils.checkpoint.checkpoint

    def counting_checkpoint(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real_checkpoint(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ttt_loss, "checkpoint", counting_checkpoint)
    kept = ttt_forward(draft, teacher, batch, 7, attention="blockwise")  # 38 rows x 40 ids: far below the default
    kept_grads = torch.autograd.grad(kept.loss, params)
    assert calls == [], "a small step was checkpointed"
    monkeypatch.setattr(ttt_loss, "KEEP_LOSS_ELEMENTS", 0)
    monkeypatch.setattr(ttt_loss, "LOSS_CHUNK_ELEMENTS", 3 * 40)
    checkpointed = ttt_forward(draft, teacher, batch, 7, attention="blockwise")
    grads = torch.autograd.grad(checkpointed.loss, params)
    assert len(calls) > 7, "above the limit every chunk is checkpointed"
    assert _rel(kept.loss, checkpointed.loss) <= 1e-6
    assert torch.equal(kept.correct, checkpointed.correct) and torch.equal(kept.n_terms, checkpointed.n_terms)
    for got, want in zip(kept_grads, grads, strict=True):
        assert _rel(got, want) <= 1e-5


def test_flex_block_mask_equals_create_block_mask() -> None:
    """The block-level mask (no [T, T] tensor) == PyTorch's create_block_mask from the same mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask

    from eagle3.draft_trainer.ttt_attention import FLEX_BLOCK, sample_causal_block_mask

    for lengths in ([130, 1, 300, 7, 200, 129], [512], [1] * 40 + [600]):
        seg = _seg_start(lengths)
        padded = -(-seg.shape[0] // FLEX_BLOCK) * FLEX_BLOCK
        sample = torch.cat([seg, torch.arange(seg.shape[0], padded)])
        mine = sample_causal_block_mask(seg, padded)

        def mask_mod(
            _b: object, _h: object, q: torch.Tensor, k: torch.Tensor, s: torch.Tensor = sample
        ) -> torch.Tensor:
            return (s[q] == s[k]) & (k <= q)

        ref = create_block_mask(mask_mod, None, None, padded, padded, device="cpu")
        assert torch.equal(mine.to_dense(), ref.to_dense())
        assert mine.full_kv_num_blocks is not None and ref.full_kv_num_blocks is not None
        assert torch.equal(mine.full_kv_num_blocks, ref.full_kv_num_blocks)
        assert torch.equal(mine.kv_num_blocks, ref.kv_num_blocks)


def test_attention_config_key_is_checked() -> None:
    from eagle3.draft_trainer.config import load_config
    from eagle3.draft_trainer.errors import ConfigError
    from eagle3.draft_trainer.ttt_attention import IMPLEMENTATIONS

    assert load_config(None, {"attention": "blockwise"}).attention == "blockwise"
    with pytest.raises(ConfigError, match="attention must be one of .*'sparse'"):
        load_config(None, {"attention": "sparse"})
    assert set(IMPLEMENTATIONS) == {"auto", "blockwise", "flex", "dense"}
