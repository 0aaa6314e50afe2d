"""How much of a batch's host-held history to onload, and how much to recompute instead.

A host hit costs PCIe bytes: rank-ref's K/V are 16 KiB a token (8 layers x K,V x 512 x bf16),
so a batch of 8 users with ~6,400 held tokens each onloads ~840 MB, 15-17 ms at PCIe 5's
~50-55 GB/s, while the H200 recomputes those users in ~18-24 ms; whole onloads made host-hit
batches slower than recompute (docs/benchmarks.md, sessions 7 and 8). The two can run at once:
onload streams layer by layer on its own streams while the model computes, so a batch costs
about ``max(onload, compute)``, and the best batch onloads part of what the host holds and
recomputes the rest.

Recomputing a user's tokens ``[x, n)`` (they attend to the onloaded prefix) costs
``t(n) - t(x)``, with ``t`` the cumulative recompute time of a user's first tokens; onloading
``[0, x)`` costs ``a * x``. ``t`` is convex (attention is quadratic in the length), so a byte
saves the most compute at the end of a long history: the choice onloads the longest users whole
first and stops at the user where onload and compute balance, onloading that one's prefix in
whole chunks (a prefix: a user's chunk ``i`` is only useful with ``0..i-1``).

The host copy stays as it is: a recomputed range is written to the user's device pages (bit for
bit what onload would have put there: the cached path computes every row the way recompute
does), so the host chunks remain valid and nothing is offloaded again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SplitCosts:
    """``onload_s``: seconds to onload one token (all layers); ``lengths`` (ascending, from 0)
    and ``recompute_s``: seconds to recompute a user's first ``lengths[j]`` tokens; past the
    last point ``t`` grows as a quadratic through the last two points' slope."""

    onload_s: float
    lengths: np.ndarray
    recompute_s: np.ndarray

    def __post_init__(self) -> None:
        n, t = np.asarray(self.lengths, float), np.asarray(self.recompute_s, float)
        if n.ndim != 1 or n.shape != t.shape or len(n) < 2 or n[0] != 0 or np.any(np.diff(n) <= 0):
            raise ValueError("SplitCosts: lengths ascending from 0, one time per length")
        if not (np.isfinite(self.onload_s) and self.onload_s >= 0) or np.any(~np.isfinite(t)):
            raise ValueError("SplitCosts: finite, non-negative costs expected")
        # cumulative costs never fall (timing noise could make a point dip)
        object.__setattr__(self, "lengths", n)
        object.__setattr__(self, "recompute_s", np.maximum.accumulate(np.maximum(t - t[0], 0)))

    def recompute(self, n) -> np.ndarray | float:
        """``t(n)``: seconds to recompute the first ``n`` tokens of a user."""
        scalar = np.ndim(n) == 0
        n = np.atleast_1d(np.asarray(n, dtype=float))
        x, t = self.lengths, self.recompute_s
        out = np.interp(n, x, t)
        past = n > x[-1]
        if past.any():  # the slope grows linearly past the table (the attention term)
            slope = (t[-1] - t[-2]) / (x[-1] - x[-2])
            d = n[past] - x[-1]
            out[past] = t[-1] + slope * d + slope / x[-1] * d * d / 2
        return float(out[0]) if scalar else out


def _held(p) -> int:
    """Tokens the plan found on host: onloaded, plus those a split chose to recompute."""
    return p.from_host + p.host_recomputed


def _set(p, x: int, chunk: int) -> None:
    held = _held(p)
    p.from_host = p.start = x
    p.host_recomputed = held - x
    p.onload = p.onload[:x // chunk]


def split_fraction(plans: list, chunk: int, fraction: float) -> int:
    """Every host hit onloads the first ``fraction`` of its held tokens (whole chunks) and
    recomputes the rest (tests and A/B runs). Returns the tokens recomputed by this choice."""
    out = 0
    for p in plans:
        if _held(p):
            _set(p, int(_held(p) * fraction) // chunk * chunk, chunk)
            out += p.host_recomputed
    return out


def split_by_cost(plans: list, chunk: int, costs: SplitCosts, scale: float = 1.0) -> int:
    """Decide each host hit's onload by ``costs`` (module docstring): the batch's
    ``max(onload, compute)`` made small; ``scale`` multiplies the recompute costs (a
    ``SplitFeedback``'s). Returns the tokens recomputed by this choice. A few array calls a
    batch, not a few per user (the host stages of a host-hit batch: ~0.6 ms for 8 users when
    ``t`` was evaluated per user)."""
    host = [p for p in plans if _held(p) and not p.transient]
    if not host:
        return 0
    a = costs.onload_s
    t = costs.recompute if scale == 1.0 else (lambda n: costs.recompute(n) * scale)
    n = len(plans)
    # Everything recomputed: each user's tokens past what it keeps on the GPU.
    ends = t(np.array([p.length for p in plans] + [0 if _held(p) else p.start for p in plans]))
    compute = float(ends[:n].sum() - ends[n:].sum())
    host.sort(key=_held, reverse=True)  # a byte onloaded saves the most on the longest
    held = np.array([_held(p) for p in host])
    saves = t(held)
    onload = 0.0
    out = 0
    for p, h, save in zip(host, held.tolist(), saves.tolist()):
        if compute - save >= onload + a * h:  # still compute-bound: all of it
            x = h
        elif onload >= compute:  # onload-bound already: more would only add to it
            x = 0
        else:  # the balance point: the best prefix in whole chunks
            xs = np.arange(0, h + 1, chunk)
            x = int(xs[int(np.argmin(np.maximum(onload + a * xs, compute - t(xs))))])
        _set(p, x, chunk)
        compute, onload = compute - (save if x == h else t(x)), onload + a * x
        out += p.host_recomputed
    return out


class SplitFeedback:
    """``split_by_cost``'s recompute costs corrected by what the device did (with ``"auto"``:
    ``CachedRankRunner.split_feedback``; H200, session 24: host-hit batches 15.89 -> 14.84 ms,
    the scale settling near 1.65). The costs are measured at start on recompute
    batches of synthetic users, while a host-hit batch's compute is the eager cached path
    (attention over paged prefixes, its own launches) and starts after its onload does (H200,
    session 23: the onload of ``auto``'s split had landed every layer at 11.8 ms, the compute
    reached the last layer at ~13.4 and finished at 14.8: it recomputed more than the balance).
    After a batch that both onloaded and recomputed host tokens, ``update`` takes when the
    compute reached the last layer's wait and when that layer's K/V had landed (ms from one
    reference): reached later, compute was dearer than modelled and ``scale`` grows (more is
    onloaded next time); reached earlier, the compute waited and ``scale`` shrinks. Damped
    (``gain``) and bounded, so one odd batch moves it little."""

    def __init__(self, gain: float = 0.5, lo: float = 0.5, hi: float = 4.0) -> None:
        self.gain, self.lo, self.hi = gain, lo, hi
        self.scale = 1.0
        self.updates = 0

    def update(self, reached_ms: float, landed_ms: float) -> float:
        if reached_ms > 0 and landed_ms > 0:
            ratio = (reached_ms / landed_ms) ** self.gain
            self.scale = min(self.hi, max(self.lo, self.scale * ratio))
            self.updates += 1
        return self.scale
