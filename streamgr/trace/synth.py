"""Synthetic KuaiRand-1K-like request traces (WORKLOADS.md rank-ref; MTServe section 5.1).

Each user has a final history length (lognormal, clipped to ``[1, max_history]``, tuned so the
mean is near the profile's); the user's events arrive over bursty *sessions*: requests inside a
session are a minute or two apart (KuaiRand is cut into requests at 60 s gaps), sessions are
separated by heavy-tailed (Pareto) gaps, so most users return within minutes and a tail returns
much later. Each request carries only the events new since the user's previous request; the
history only grows by appending. Candidates are sampled uniformly per request, seeded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..progress import Progress
    from .format import Header


@dataclass(frozen=True)
class Profile:
    name: str
    users: int
    mean_history: float  # events
    max_history: int
    events_per_request: float  # mean new events per request
    session_requests: float  # mean requests per session
    num_items: int
    num_actions: int
    candidates: int


PROFILES = {
    "kuairand-1k": Profile("kuairand-1k", 1000, 6400, 20000, 5.4, 12, 1_000_000, 256, 256),
    # rank-small sized: runs on a CPU in seconds.
    "small": Profile("small", 16, 320, 500, 1.6, 12, 1000, 16, 8),
    "tiny": Profile("tiny", 6, 40, 60, 3.0, 4, 200, 16, 4),
    # Generate traces (SID models): item histories, no actions, no candidates.
    "gen": Profile("gen", 200, 60, 256, 3.0, 6, 1000, 1, 0),
}


@dataclass
class SynthRequest:
    time: float  # seconds since the trace start
    user: int
    items: np.ndarray  # events new since the user's previous request
    actions: np.ndarray
    candidates: np.ndarray


def _lengths(rng: np.random.Generator, p: Profile, n: int) -> np.ndarray:
    # Lognormal with sigma 1 has mean exp(mu + 1/2); clipping at max trims the mean a little.
    sigma = 1.0
    mu = np.log(p.mean_history) - sigma ** 2 / 2
    return np.clip(rng.lognormal(mu, sigma, size=n).astype(np.int64), 1, p.max_history)


def synth_trace(profile: str | Profile, seed: int = 0, users: int | None = None,
                progress: "Progress | None" = None) -> list[SynthRequest]:
    """A whole trace in arrival order (``progress`` advances once per user)."""
    p = PROFILES[profile] if isinstance(profile, str) else profile
    rng = np.random.default_rng(seed)
    n_users = users or p.users
    out: list[SynthRequest] = []
    for user, total in enumerate(_lengths(rng, p, n_users)):
        if progress is not None:
            progress.update()
        # Split the user's events into requests of >= 1 event (geometric sizes).
        sizes = []
        left = int(total)
        while left > 0:
            s = min(left, int(rng.geometric(1.0 / p.events_per_request)))
            sizes.append(s)
            left -= s
        t = float(rng.uniform(0, 3600))
        in_session = 0
        session_len = max(1, int(rng.geometric(1.0 / p.session_requests)))
        for s in sizes:
            out.append(SynthRequest(
                t, user, rng.integers(p.num_items, size=s), rng.integers(p.num_actions, size=s),
                rng.choice(p.num_items, size=min(p.candidates, p.num_items), replace=False)))
            in_session += 1
            if in_session >= session_len:  # a heavy-tailed gap to the next session
                t += 600 * (rng.pareto(1.2) + 1)
                in_session = 0
                session_len = max(1, int(rng.geometric(1.0 / p.session_requests)))
            else:
                t += 60 + rng.exponential(60)
    out.sort(key=lambda r: r.time)
    return out


def with_full_history(trace: list[SynthRequest]):
    """Yield (request, full items, full actions) with each user's history accumulated so far."""
    tl = Timeline(trace)
    for n in range(len(trace)):
        yield tl.request(n)


class Timeline:
    """Each user's whole event sequence once, and per request where its history ends, so the
    full history of any request is a view (no per-request copies on long traces)."""

    def __init__(self, trace: list[SynthRequest]) -> None:
        self.trace = trace
        parts: dict[int, tuple[list, list]] = {}
        self.ends = np.empty(len(trace), dtype=np.int64)
        for r in trace:
            items, actions = parts.setdefault(r.user, ([], []))
            items.append(r.items)
            actions.append(r.actions)
        self.items = {u: np.concatenate(i) for u, (i, _) in parts.items()}
        self.actions = {u: np.concatenate(a) for u, (_, a) in parts.items()}
        seen: dict[int, int] = {}
        for n, r in enumerate(trace):
            seen[r.user] = seen.get(r.user, 0) + len(r.items)
            self.ends[n] = seen[r.user]

    def request(self, n: int):
        """(request, full items, full actions) of request ``n``."""
        r = self.trace[n]
        e = self.ends[n]
        return r, self.items[r.user][:e], self.actions[r.user][:e]

    def state_before(self, n: int) -> dict[int, int]:
        """Each user's history length (events) just before request ``n``."""
        out: dict[int, int] = {}
        for i in range(n):
            r = self.trace[i]
            out[r.user] = int(self.ends[i])
        return out

    def prefill(self, s0: int, order: list[int], batch: int = 8) -> list[list]:
        """Batches (of ``batch``) that load each user of ``order`` with its history as of
        request ``s0``: replayed untimed, they leave a cache holding what a server running since
        the trace's beginning would hold."""
        state = self.state_before(s0)
        users = sorted({self.trace[n].user for n in order} & set(state))
        first: dict[int, SynthRequest] = {}
        for n in order:
            first.setdefault(self.trace[n].user, self.trace[n])
        return [[(first[u], self.items[u][:state[u]], self.actions[u][:state[u]])
                 for u in users[i:i + batch]] for i in range(0, len(users), batch)]


def write_synth(profile: str, out, users: int | None = None, seed: int = 0, top_k: int = 10,
                progress: bool = False) -> "Header":
    """``streamgr trace synth``: a synthetic trace file (rank, or generate for ``gen``), with a
    progress bar over users, then records, when asked."""
    from ..progress import Progress
    from .format import GenerateEvent, Header, RankEvent, TraceWriter, check_output
    p = PROFILES[profile]
    check_output(out)
    if users is not None and users < 1:  # (0 read as "the profile's count")
        raise ValueError(f"--users must be at least 1, got {users}")
    with Progress(users or p.users, f"synth {profile} users", enabled=progress) as bar:
        trace = synth_trace(p, seed, users, bar)
    kind = "generate" if profile == "gen" else "rank"
    header = Header(kind=kind, source=f"synth:{profile}:seed={seed}", num_items=p.num_items,
                    num_actions=p.num_actions, users=users or p.users, records=len(trace))
    with TraceWriter(out, header) as w, Progress(len(trace), f"write {out}",
                                                 enabled=progress) as bar:
        for r in trace:
            bar.update()
            if kind == "generate":
                w.write(GenerateEvent(r.time, r.user, r.items.tolist(), top_k))
            else:
                w.write(RankEvent(r.time, r.user, r.items.tolist(), r.actions.tolist(),
                                  r.candidates.tolist()))
    return header
