"""Predicted step time: fixed + per_token * new tokens + per_context * context tokens attended
+ per_adapter * distinct LoRA adapters in the step.

Fitted from the engine's own measured steps (exponentially weighted least squares, so it follows the
device's current speed), seeded by a short calibration when the engine starts. The scheduler reads the
coefficients only, so a test can hand it any object that has them (`per_adapter` may be missing: 0).

per_adapter is what each distinct adapter adds to a step beyond its tokens' share of per_token: every
adapted linear reads that adapter's A and B once per step (at rank 16 on every projection of SmolLM2-135M,
~20 MB of fp32, ~4% of the base model's bytes) and runs its own tiles (workers/engine/lora.py,
kernels/lora_ops.py). Calibration seeds it from the same decode batch run with and without adapters in the
(zero-filled) slots, which costs what real weights cost; steps with and without adapters refine it.

The fit is robust to stalls: on a shared or oversubscribed host a step now and then takes many times its
usual time (the OS ran another thread, a GC pause), and a least-squares mean over such steps would predict
every step slower than it is, shrinking the online step budget (and offline throughput) for nothing. An
observation counts at most STALL_CLIP times what the model predicted, so the fit follows the typical step
(a genuine slow-down still moves it, by up to that factor per step), and calibration keeps the fastest of
three runs of each shape.

A wrong calibration is noticed and undone (drift): if calibration ran while another process loaded the
host, the seed can be many times off, and steady steps of one shape cannot correct it by themselves (they
cannot separate fixed from per-token cost, the ridge keeps pulling toward the bad prior, old observations
fade slowly, and clipping lets a too-fast model climb only so fast). So the model keeps its last
DRIFT_WINDOW observations, unclipped (a clipped step would hide a real change), and after each step
compares them with what the current fit predicts for them. When at least DRIFT_QUORUM of them are off the
same way by more than DRIFT_BAND, the fit no longer describes the device: every coefficient and the prior
are scaled by the window's median observed / predicted ratio (a load or a clock change scales the whole
step), the accumulated statistics are dropped (the scaled fit, now the prior, carries what they knew about
the split between the terms), and `recalibrations` counts it. Three steps in four off the same way is no
stall pattern (one step in ten at 20x never comes near), nor a fit that is right on some shapes and wrong
on others (the data fix that, and a rescale would not); the window starts empty after a rescale, so it
fires at most once per DRIFT_WINDOW steps.
"""
import numpy as np

STALL_CLIP = 1.5          # an observed step counts at most this many times the prediction (once seeded,
                          # or after WARMUP steps of an unseeded model)
WARMUP = 8
DRIFT_WINDOW = 16         # recent steps whose observed / predicted ratios are checked
DRIFT_BAND = 1.5          # observed / predicted beyond this either way is off
DRIFT_QUORUM = 0.75       # this share of the window off the same way rescales the model (by the median)
NF = 4                    # features: 1 (fixed), new tokens, context tokens attended, distinct adapters


def attended(start: int, num_new: int) -> int:
    """Context tokens the new tokens attend to: token i of the chunk sees start + i + 1 positions."""
    return num_new * start + num_new * (num_new + 1) // 2


class CostModel:
    def __init__(self, fixed: float = 0.0, per_token: float = 0.0, per_context: float = 0.0,
                 per_adapter: float = 0.0, decay: float = 0.995, prior_weight: float = 0.2):
        self.fixed, self.per_token, self.per_context, self.per_adapter = fixed, per_token, per_context, per_adapter
        self.decay = decay
        self.prior_weight = prior_weight   # in steps: how many observations the prior counts as
        self._xtx = np.zeros((NF, NF))
        self._xty = np.zeros(NF)
        self._prior = self._theta()
        self.observations = 0
        self.seeded = False                # seeded by calibration: observations are clipped from the start
        self.recalibrations = 0            # times drift rescaled the model
        self._recent = np.zeros((DRIFT_WINDOW, NF + 1))   # rows of [features..., seconds], unclipped
        self._recent_n = 0                 # rows filled since the last seed or rescale

    def _theta(self) -> np.ndarray:
        return np.array([self.fixed, self.per_token, self.per_context, self.per_adapter])

    def _set(self, theta) -> None:
        self.fixed, self.per_token, self.per_context, self.per_adapter = (float(v) for v in theta)

    def predict(self, num_tokens: int, num_attended: int, num_adapters: int = 0) -> float:
        return self.fixed + self.per_token * num_tokens + self.per_context * num_attended + \
            self.per_adapter * num_adapters

    def seed(self, fixed: float, per_token: float, per_context: float, per_adapter: float | None = None) -> None:
        """per_adapter None keeps the current one."""
        self._set((fixed, per_token, per_context, self.per_adapter if per_adapter is None else per_adapter))
        self._prior = self._theta()
        self.seeded = True
        self._recent_n = 0

    def observe(self, num_tokens: int, num_attended: int, seconds: float, num_adapters: int = 0) -> None:
        armed = self.seeded or self.observations >= WARMUP
        self._recent[self._recent_n % DRIFT_WINDOW] = (1.0, num_tokens, num_attended, num_adapters, seconds)
        self._recent_n += 1
        predicted = self.predict(num_tokens, num_attended, num_adapters)
        if predicted > 0 and armed:
            # One step slowed by something outside the engine (another process, a GC pause) must not
            # drag the fit: clip it to a little more than what the model expected.
            seconds = min(seconds, STALL_CLIP * predicted)
        x = np.array([1.0, float(num_tokens), float(num_attended), float(num_adapters)])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self.observations += 1
        self._refit()
        if armed and self._recent_n >= DRIFT_WINDOW:
            self._check_drift()

    def _check_drift(self) -> None:
        """Rescale the model when the current fit keeps mispredicting the recent (unclipped) steps."""
        theta = self._theta()
        predicted = self._recent[:, :NF] @ theta
        ok = predicted > 0
        if ok.sum() < DRIFT_WINDOW // 2:
            return
        ratios = self._recent[ok, NF] / predicted[ok]
        quorum = DRIFT_QUORUM * ratios.size
        if (ratios > DRIFT_BAND).sum() < quorum and (ratios < 1 / DRIFT_BAND).sum() < quorum:
            return
        ratio = float(np.median(ratios))
        if not 0 < ratio < np.inf:
            return
        self._set(theta * ratio)
        self._prior = theta * ratio
        self._xtx = np.zeros((NF, NF))
        self._xty = np.zeros(NF)
        self._recent_n = 0
        self.recalibrations += 1

    def _refit(self) -> None:
        # The adapter term is fitted once observed steps had adapters; until then it keeps its prior (its
        # column is all zero: a least-squares fit would drop it to 0).
        n = NF if self._xtx[NF - 1, NF - 1] > 1e-12 * self._xtx[0, 0] else NF - 1
        xtx, xty, prior = self._xtx[:n, :n], self._xty[:n], self._prior[:n]
        # Ridge toward the prior, each coefficient scaled by its feature's typical size so the pull is even.
        ridge = self.prior_weight * np.diag(np.maximum(np.diag(xtx), 1e-9) / xtx[0, 0])
        a = xtx + ridge
        b = xty + ridge @ prior
        theta = np.linalg.lstsq(a, b, rcond=None)[0]
        free = theta > 0
        if not free.all():                 # no negative costs: refit with those coefficients at zero
            theta = np.zeros(n)
            idx = np.flatnonzero(free)
            if idx.size:
                theta[idx] = np.linalg.lstsq(a[np.ix_(idx, idx)], b[idx], rcond=None)[0]
            theta = np.maximum(theta, 0.0)
        self._set(np.concatenate([theta, self._prior[n:]]))

    def as_dict(self) -> dict:
        return {"fixed_s": self.fixed, "per_token_s": self.per_token, "per_context_s": self.per_context,
                "per_adapter_s": self.per_adapter, "observations": self.observations,
                "recalibrations": self.recalibrations}
