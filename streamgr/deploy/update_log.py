"""The update log of a streamgr Ray Serve application (``deploy/ray_serve.py``).

One detached actor an application holds its live updates in, in order: the driver appends a
change; every replica applies what it has not applied yet and acknowledges how far it got,
with the error of each change it refused, and its engine's versions and stats; the driver's
``update`` waits for every live replica and raises what they refused (``refusal``). A
replacement replica replays the whole log. ``Reports`` reads the replicas' reports for the
driver's ``stats`` without holding its event loop.
"""

from __future__ import annotations

import logging

import ray

from ..errors import StreamgrError, error_for_code

log = logging.getLogger("streamgr.deploy")


def refusal(n: int, refused: dict[str, tuple[str, str]], applied: list[str]) -> StreamgrError:
    """The error of an update the replicas ``refused`` ({replica: (error code, message)}):
    their own type when every live replica refused it (``errors.error_for_code``, as the socket
    client types a server's errors), so a caller handles it as the embedded engine's; else a
    ``StreamgrError`` saying the replicas now differ."""
    replica, (code, msg) = sorted(refused.items())[0]
    if not applied:
        return error_for_code(code, f"{msg} (update {n} refused by every replica; they serve "
                                    f"the version they served)")
    return StreamgrError(f"update {n} applied by replicas {sorted(applied)} but refused by "
                         f"{sorted(refused)} ({replica}: {code}: {msg}): the replicas now serve "
                         f"different versions; update them again")


def update_log_name(app: str) -> str:
    return f"{app}-updates"


@ray.remote(num_cpus=0)
class UpdateLog:
    """The application's updates, in order, and how far each replica has applied them."""

    def __init__(self) -> None:
        self.updates: list[dict] = []
        self.acks: dict[str, int] = {}
        self.refused: dict[int, dict[str, tuple[str, str]]] = {}  # update -> replica -> error
        self.last: dict[str, dict] = {}  # replica -> its engine's versions and stats, last

    def append(self, change: dict) -> int:
        self.updates.append(change)
        return len(self.updates)

    def since(self, n: int) -> list[dict]:
        return self.updates[n:]

    def ack(self, replica: str, n: int, refused: dict | None = None,
            report: dict | None = None) -> None:
        self.acks[replica] = n
        for i, err in (refused or {}).items():
            self.refused.setdefault(int(i), {})[replica] = tuple(err)
        if report is not None:
            self.last[replica] = report

    def reports(self) -> dict[str, dict]:
        """Each replica's last report: ``{"versions": ..., "stats": ...}`` of its engine."""
        return dict(self.last)

    def state(self) -> tuple[int, dict]:
        return len(self.updates), dict(self.acks)

    def refusals(self, n: int) -> dict[str, tuple[str, str]]:
        """The replicas that refused update ``n`` (1-based), with (error type, message)."""
        return dict(self.refused.get(n, {}))


class Reports:
    """The replicas' last reports as the driver's ``stats`` shows them. A read takes what the
    read before it asked the log for and asks again, so it never waits on the log actor but the
    first time (at most ``first_wait`` seconds): a server's monitoring calls (``/metrics``,
    ``stats``) run on its event loop, and a slow or restarting log actor must not hold it. The
    reports are then one read old at most (replicas report every ~0.2 s)."""

    def __init__(self, actor, first_wait: float) -> None:
        self.actor, self.first_wait = actor, first_wait
        self._pending = None
        self._last: dict | None = None

    def read(self) -> dict | None:
        """The reports fetched last (None: none yet, or the log failed to answer)."""
        wait = 0.0
        if self._pending is None:  # the first read
            self._pending = self.actor.reports.remote()
            wait = self.first_wait
        ready, _ = ray.wait([self._pending], timeout=wait)
        if ready:
            try:
                self._last = ray.get(ready[0])
            except Exception as err:  # noqa: BLE001 - the log actor restarting: ask again
                log.warning("replica stats unavailable: %r", err)
                self._last = None
            self._pending = self.actor.reports.remote()
        return self._last


def update_log(app: str):
    """The application's update log actor (created on first use; survives the driver)."""
    return UpdateLog.options(name=update_log_name(app), namespace="streamgr",
                             get_if_exists=True, lifetime="detached").remote()
