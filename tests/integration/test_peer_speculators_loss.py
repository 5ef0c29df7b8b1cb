"""eagle3's TTT loss against speculators' own Eagle3 draft and loss, one batch, the same weights (issue 32).

The same real features (a tiny random Llama verifier through the hf backend, ``write_features``) are read
by each trainer's own data path: eagle3's ``FeaturesData.load`` (a packed batch) and speculators'
``ArrowDataset`` + ``shift_batch`` + ``CollateFn`` over ``eagle3 convert --to speculators``'s output (a
padded batch). eagle3's draft goes to speculators through ``eagle3 export --format speculators`` and
speculators' ``from_pretrained``, so both forwards run the same weights. What the test pins down:

* **Which terms count** (``test_the_two_trainers_supervise_different_terms``): term ``(k, t)`` (step ``k``
  at row ``t`` predicts token ``t+k+2`` from the teacher at row ``t+k+1``) counts in eagle3 iff the
  *predicted* token ``t+k+2`` is an assistant token (``ttt.step_valid``); in speculators iff the step's
  *input* token ``t+k+1`` is one (``shift_batch`` keeps ``loss_mask[1:]`` aligned with the input ids and
  ``align_for_step`` slides it with the targets). So per step and assistant span, speculators
  supervises one term eagle3 does not (predicting the token after the span's last token: ``<|im_end|>``'s
  successor, which a server never drafts since generation stops there) and eagle3 one speculators does
  not (predicting the span's first token, which the verifier's prefill produces, never a draft). Equal
  counts, shifted terms; asserted exactly, from the masks.
* **The same loss and gradients once the terms agree** (``test_same_gradients_and_the_entropy_gap``): with
  speculators given eagle3's mask convention (its shifted mask moved one more row), its loss equals
  eagle3's minus the teacher entropy term: eagle3 minimises the cross-entropy ``-sum p log q``,
  speculators the KL ``sum p log(p/q)``: the same gradient, values apart by ``sum_k decay^k
  mean_terms H(p)``, the teacher's draft-vocab entropy, a constant of the data. Both normalise each step
  by its own term count and weight step ``k`` by ``decay^k``. Gradients of every trained tensor equal to
  fp32 tolerance (speculators keeps ``lm_head`` frozen: it has no gradient there; eagle3 trains it).
  With the three Eagle-3.1 norms on (speculators' own defaults) the same holds: speculators' model is the
  reference for what each flag means. Rope positions differ by one (speculators' ``position_ids`` start at 1
  after ``shift_batch``; eagle3's at 0, as vLLM's drafter): rope is relative, so scores are equal up to
  rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eagle3.core.protocol.prepared import PreparedSample
from eagle3.draft_trainer.checkpoint import save_draft
from eagle3.draft_trainer.data import FeaturesData
from eagle3.draft_trainer.export import export_draft
from eagle3.draft_trainer.interop import SIDECAR
from eagle3.draft_trainer.interop_speculators import to_speculators
from eagle3.draft_trainer.model import NORM_FLAGS, EagleDraft, draft_config_from_target
from eagle3.draft_trainer.ttt import PackedBatch, Teacher, load_verifier_tensors, step_valid, ttt_forward
from eagle3.draft_trainer.vocab import build_draft_vocab, save_vocab
from tests.trainer_helpers import tiny_llama_dir, write_features

pytestmark = pytest.mark.integration

VOCAB, DRAFT_VOCAB, K, DECAY = 97, 64, 4, 0.8
AUX = (1, 2, 3)
# (prompt, answer, prompt, answer) spans: every sample opens with >= K + 1 prompt tokens, as a chat sample
# does, so speculators' steps that read past a sample's end (into the next one) meet masked rows only
MASKS = ([0] * 6 + [1] * 10 + [0] * 5 + [1] * 9, [0] * 5 + [1] * 20, [0] * 7 + [1] * 15)


def _samples() -> list[PreparedSample]:
    rng = np.random.default_rng(3)
    return [
        PreparedSample(f"s{i}", [int(x) for x in rng.integers(3, VOCAB, size=len(m))], m) for i, m in enumerate(MASKS)
    ]


def _setup(tmp_path: Path, norms: dict[str, bool] | None = None) -> dict[str, Any]:
    speculators = pytest.importorskip("speculators")
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    model_dir = tiny_llama_dir(tmp_path / "verifier", vocab_size=VOCAB)
    samples = _samples()
    features = write_features(samples, tmp_path / "features", model_dir, aux_layer_ids=AUX)
    target, tensors = load_verifier_tensors(model_dir)
    teacher = Teacher(tensors["norm"], tensors["lm_head"], float(target["rms_norm_eps"]))
    data = FeaturesData(features, heldout_fraction=0.0)
    batch = data.load(list(range(len(samples))))  # canonical order: s0, s1, s2, packed
    # a draft vocabulary that holds every teacher argmax (so eagle3 drops no term for it), filled by counts
    counts = np.zeros(VOCAB, dtype=np.int64)
    counts[teacher(batch.final).argmax(-1).numpy()] += 1000
    counts += np.bincount(batch.input_ids.numpy(), minlength=VOCAB)
    vocab, stats = build_draft_vocab(counts, DRAFT_VOCAB)
    save_vocab(vocab, stats, counts, tmp_path / "vocab")

    torch.manual_seed(0)
    draft = EagleDraft(draft_config_from_target(target, DRAFT_VOCAB, AUX, norms=norms))
    with torch.no_grad():  # every tensor distinct from an init (norms too), and exactly bf16: the export's dtype
        for p in draft.parameters():
            p.copy_((p + 0.05 * torch.randn_like(p)).bfloat16().float())
    draft.set_vocab(torch.from_numpy(vocab.d2t), torch.from_numpy(vocab.t2d))
    draft.embed_tokens.copy_(tensors["embed"])
    save_draft(draft, tmp_path / "run" / "draft")
    export = export_draft(tmp_path / "run", tmp_path / "export", format="speculators", verifier=str(model_dir))

    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(export))
    config.transformer_layer_config._attn_implementation = "sdpa"  # its flex attention has no CPU backward
    peer = speculators.SpeculatorModel.from_pretrained(str(export), config=config).float()
    peer.load_verifier_weights()  # its own attach: verifier_norm, verifier_lm_head (the t2d rows)
    with torch.no_grad():
        peer.embed_tokens.weight.copy_(tensors["embed"])  # loaded only where NaN: set it, as eagle3's is
    # the flags reach speculators' config from eagle3's export (all off unless asked)
    assert {n: getattr(config, n) for n in NORM_FLAGS} == {n: bool((norms or {}).get(n)) for n in NORM_FLAGS}

    spec_dir = tmp_path / "speculators"
    to_speculators(features, spec_dir, tmp_path / "vocab")
    dataset = ArrowDataset(
        max_len=96, datapath=spec_dir, on_missing="raise", train_ratio=1.0, hidden_states_dtype=torch.float32
    )
    import json

    rows = json.loads((spec_dir / SIDECAR).read_text())["sample_ids"]
    order = [rows.index(s.sample_id) for s in samples]  # eagle3's packing order
    collate = CollateFn(96, int(target["hidden_size"]), len(AUX), dtype=torch.float32, preprocess=shift_batch)
    spec_batch = collate([dataset[i] for i in order])
    spec_batch.pop("error_records")
    return {"draft": draft, "teacher": teacher, "batch": batch, "peer": peer, "spec_batch": spec_batch}


def _spec_rows(batch: PackedBatch) -> torch.Tensor:
    """[T] the speculators row of each eagle3 row (-1 for a sample's last row, which ``shift_batch`` drops)."""
    starts = sorted(set(batch.seg_start.tolist()))
    out = torch.full((batch.n_tokens,), -1, dtype=torch.long)
    for s, a in enumerate(starts):
        end = int(batch.seg_end[a])
        out[a : end - 1] = torch.arange(a - s, end - 1 - s)
    return out


def _peer_forward(peer: Any, spec_batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from speculators.losses import eager

    _tokens, loss, metrics = peer(
        **spec_batch, ttt_steps=K, ttt_step_loss_decay=DECAY, loss_config={"kl_div": (eager.kl_div_loss, 1.0)}
    )
    return loss, metrics


def test_the_two_trainers_supervise_different_terms(tmp_path: Path) -> None:
    s = _setup(tmp_path)
    batch, spec_rows = s["batch"], _spec_rows(s["batch"])
    result = ttt_forward(s["draft"], s["teacher"], batch, K, DECAY, attention="dense")
    result.loss.backward()
    loss, metrics = _peer_forward(s["peer"], s["spec_batch"])
    loss.backward()
    n = batch.n_tokens
    rows = torch.arange(n)
    for k in range(K):
        ours = step_valid(batch, k)  # predicted token t+k+2 is an assistant token (inside the sample)
        assert torch.equal(result.n_terms[k], ours.sum().float())  # no term dropped for the vocab here
        # speculators: the input token t+k+1 is an assistant token (inside the sample)
        nxt = (rows + k + 1).clamp(max=n - 1)
        theirs = (rows + k + 1 < batch.seg_end) & batch.loss_mask[nxt]
        assert int(metrics[f"full_acc_{k}_total"]) == int(theirs.sum()), k
        # the difference, term by term: one per assistant span at each end
        only_ours, only_theirs = ours & ~theirs, theirs & ~ours
        span_starts = batch.loss_mask & ~torch.cat([torch.zeros(1, dtype=torch.bool), batch.loss_mask[:-1]])
        first = span_starts & (batch.positions > 0)
        assert torch.equal(only_ours.nonzero().squeeze(1) + k + 2, first.nonzero().squeeze(1)), k
        assert int(only_theirs.sum()) == int(first.sum()) == 4  # 4 spans, each ending on a prompt or last row
        assert bool((spec_rows[rows[only_theirs]] >= 0).all())  # all inside speculators' shifted rows
    # those shifted terms (4 of 54 per step here) move every gradient by a few percent (docs: 4-13 %)
    theirs_params = dict(s["peer"].named_parameters())
    for name, p in s["draft"].named_parameters():
        other = theirs_params[name.replace("midlayer.", "layers.0.")].grad
        if other is not None and p.grad is not None:
            assert float((other - p.grad).norm() / p.grad.norm()) > 0.02, name


@pytest.mark.parametrize("norms", [None, dict.fromkeys(NORM_FLAGS, True)], ids=["eagle3", "eagle3.1-norms"])
def test_same_gradients_and_the_entropy_gap(tmp_path: Path, norms: dict[str, bool] | None) -> None:
    """Also with the three Eagle-3.1 norms on: speculators' own model is the reference for what each means
    (``norm_before_fc``'s ``input_norm``, the residual after ``hidden_norm``, the post-norm hidden fed back)."""
    s = _setup(tmp_path, norms)
    draft, peer, batch, spec_batch = s["draft"], s["peer"], s["batch"], s["spec_batch"]
    # speculators' mask in eagle3's convention: shifted row j supervises what eagle3's row j - k does at step k
    spec_rows = _spec_rows(batch)
    moved = torch.zeros_like(spec_batch["loss_mask"])
    rows = torch.arange(batch.n_tokens)
    valid = (rows + 2 < batch.seg_end) & batch.loss_mask[(rows + 2).clamp(max=batch.n_tokens - 1)]
    keep = spec_rows >= 0
    moved[0, spec_rows[keep]] = valid[keep].to(moved.dtype)
    spec_batch = dict(spec_batch, loss_mask=moved)

    result = ttt_forward(draft, s["teacher"], batch, K, DECAY, attention="dense")
    result.loss.backward()
    loss, metrics = _peer_forward(peer, spec_batch)
    loss.backward()

    # the entropy term: sum_k decay^k * mean over step k's terms of H(teacher at the term's row t+k+1)
    with torch.no_grad():
        logp = s["teacher"](batch.final, draft.target_ids).log_softmax(-1)  # [T, Vd]
        entropy = -(logp.exp() * logp).sum(-1)  # [T]
        gap = sum(
            DECAY**k * entropy[(rows + k + 1).clamp(max=batch.n_tokens - 1)][step_valid(batch, k)].mean()
            for k in range(K)
        )
    for k in range(K):
        assert int(metrics[f"full_acc_{k}_total"]) == int(result.n_terms[k])
    torch.testing.assert_close(loss.detach(), result.loss.detach() - gap, rtol=1e-5, atol=1e-5)
    assert float(gap) > 0.5  # a real gap, not rounding: the values differ, the objective does not

    theirs = dict(peer.named_parameters())
    compared = 0
    for name, p in draft.named_parameters():
        peer_name = name.replace("midlayer.", "layers.0.")
        if name == "lm_head.weight":
            assert not theirs[peer_name].requires_grad and theirs[peer_name].grad is None  # frozen there
            assert p.grad is not None and float(p.grad.abs().max()) > 0  # trained here
            continue
        assert p.grad is not None and theirs[peer_name].grad is not None, name
        torch.testing.assert_close(theirs[peer_name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        compared += 1
    assert compared == (13 if norms else 12)  # fc, 4 attention, 3 mlp, 3 layer norms, the final norm (+ input_norm)
