"""Slots of one kind of work (dry runs, batch file checks) that the teams of an API process share."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator


class SlotsBusy(RuntimeError):
    """No slot is free for the caller now; the message says whose limit it met."""


class TeamSlots:
    """`size` slots, of which a team holds at most `share` (None: half of them rounded up, so that another
    team always finds one). Taking one never waits: past either limit `hold` raises `busy` at once, holding
    no thread. `share_setting` names the setting a refused team is pointed to. Thread-safe."""

    def __init__(
        self, kind: str, size: int, share: int | None, share_setting: str, busy: type[SlotsBusy] = SlotsBusy
    ) -> None:
        self.kind, self.size, self.share_setting, self._busy = kind, size, share_setting, busy
        self.share = share if share is not None else math.ceil(size / 2)
        self._lock = threading.Lock()
        self._held: dict[str | None, int] = {}

    @contextlib.contextmanager
    def hold(self, team: str | None) -> Iterator[None]:
        with self._lock:
            if sum(self._held.values()) >= self.size:
                raise self._busy(f"{self.size} {self.kind} are in progress here; try again shortly")
            if team is not None and self._held.get(team, 0) >= self.share:
                raise self._busy(
                    f"your team has {self.share} {self.kind} in progress here, its share of the {self.size} this "
                    f"server runs at once ({self.share_setting}); try again when one has answered"
                )
            self._held[team] = self._held.get(team, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._held[team] -= 1
                if not self._held[team]:
                    del self._held[team]
