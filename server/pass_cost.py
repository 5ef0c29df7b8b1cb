"""What a unit of backend work costs in the fairness clock's unit (token-equivalents of full extraction passes).

A forward pass takes a fixed time plus a time per token, ``t = a + b * n``: on a GPU the fixed part is the
kernel launches and the scheduler's own work, on this CPU the Python around the model, so a small pass costs
far more per token than a full one. Charging an extraction only its tokens lets a tenant whose closed-loop
clients fill small lane passes (server/lanes.py) take two thirds of the backend time while its clock says
half (measured with 16 loops of 8 tokens beside a bulk tenant, ``tests/e2e/test_lane_fairness.py``).

So the model keeps two running means of (tokens, seconds), one of passes at least half full and one of
smaller passes, and fits ``a`` and ``b`` through them. An extraction of ``n`` tokens is charged
``(a + b * n)`` seconds at the full passes' rate: a full pass costs its tokens, a small pass its share of
the fixed time too. A pass is not charged its own measured time: that would add another process's CPU
use to one tenant's bill (two equal tenants then drifted to 42 vs 71 samples). Work of other kinds (a
generate slice) is charged the time it took, at the same rate (``token_equivalents``). Until both kinds of
extraction pass have been seen, an extraction costs its tokens.
"""

from __future__ import annotations

DECAY = 0.8  # weight of the running means' past (the last ~5 passes of each kind dominate)


class PassCost:
    def __init__(self, max_batch_tokens: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self._full: tuple[float, float] | None = None  # running mean (tokens, seconds), passes >= half full
        self._small: tuple[float, float] | None = None  # likewise, smaller passes

    def observe(self, n_tokens: int, seconds: float) -> None:
        """One extraction pass the backend computed: ``n_tokens`` tokens in ``seconds``."""
        full = 2 * n_tokens >= self.max_batch_tokens
        old = self._full if full else self._small
        new = (float(n_tokens), seconds) if old is None else _mix(old, (float(n_tokens), seconds))
        if full:
            self._full = new
        else:
            self._small = new

    @property
    def token_rate_s(self) -> float:
        """Tokens per backend second of full passes (0 until one was seen): the clock's unit."""
        return self._full[0] / self._full[1] if self._full and self._full[1] > 0 else 0.0

    def fixed_and_per_token_s(self) -> tuple[float, float] | None:
        """``(a, b)`` of ``t = a + b * n``, or None while the two kinds of pass cannot tell them apart."""
        if self._full is None or self._small is None:
            return None
        (n_f, t_f), (n_s, t_s) = self._full, self._small
        if n_f - n_s < self.max_batch_tokens / 8:
            return None
        b = (t_f - t_s) / (n_f - n_s)
        if b <= 0:  # noise: small passes took as long as full ones
            return None
        a = max(0.0, t_s - b * n_s)
        return a, b

    def extraction(self, n_tokens: int) -> float:
        """Token-equivalents charged for an extraction of ``n_tokens`` (one group of a pass)."""
        model, rate = self.fixed_and_per_token_s(), self.token_rate_s
        if model is None or not rate:
            return float(n_tokens)
        a, b = model
        return (a + b * n_tokens) * rate

    def token_equivalents(self, seconds: float, n_tokens: int) -> float:
        """Backend time as token-equivalents. Until a full pass has been seen, at the rate of the small
        passes: what their extractions were charged (their tokens) per second, so a generate slice is
        charged on the same scale as the extractions beside it. Charged its ``n_tokens`` instead, a slice
        of 0.018 s cost 24 where the lane pass beside it cost 16 for 0.0026 s (a server whose warm-up
        passes are all under half of ``max_batch_tokens`` knows no full pass until a bulk client comes).
        ``n_tokens`` while no extraction at all has been seen."""
        rate = self.token_rate_s
        if not rate and self._small is not None and self._small[1] > 0:
            rate = self._small[0] / self._small[1]
        return seconds * rate if rate else float(n_tokens)


def _mix(old: tuple[float, float], new: tuple[float, float]) -> tuple[float, float]:
    return DECAY * old[0] + (1 - DECAY) * new[0], DECAY * old[1] + (1 - DECAY) * new[1]
