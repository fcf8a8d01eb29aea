"""The stages of a start: named, back-to-back stretches of one process's start-up, each logged as
`startup stage <name>: <seconds> s` as it ends.

A process keeps one `StartupStages` from its start: every `mark` ends the stage running since the
last one, so the stages cover the start with no gap and their seconds add up to its whole. Each
stage also counts the CPU seconds the process spent in it (all its threads): far fewer than its
seconds, and the stage waited (for the other process, the GPU, the disk, or a busy CPU). The
launch_server process, its scheduler child (whose stages travel to the parent with its ready
message) and the offline Engine each keep one; /get_server_info and bench_startup report them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
# the one format of a stage's log line; bench_startup parses it (STAGE_LINE there)
LOG_FORMAT = "startup stage %s: %.2f s (cpu %.2f s)"


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float
    cpu_seconds: float
    ended_at: float  # epoch seconds


def process_started_at() -> float | None:
    """This process's start in epoch seconds (to the kernel's clock tick), or None where /proc
    does not say (not Linux): the interpreter's own start-up is then no stage."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError):
        return None


class StartupStages:
    """The stages of one start, from `started_at` (epoch seconds; default now) on."""

    def __init__(self, process: str, started_at: float | None = None) -> None:
        self.process = process
        now = time.time()
        self.started_at = now if started_at is None else min(started_at, now)
        self._last = self.started_at
        # CPU seconds before construction count towards the first stage only from a process's
        # own start (before that, this process did not exist)
        self._last_cpu = 0.0 if started_at is not None else time.process_time()
        self.stages: list[Stage] = []

    @classmethod
    def from_process_start(cls, process: str) -> StartupStages:
        """Stages from this process's own start, its interpreter's start-up the first."""
        return cls(process, process_started_at())

    def mark(self, name: str) -> None:
        """End the stage `name`: the time since the last mark (or the start)."""
        now = max(time.time(), self._last)  # a wall clock set back must not make one negative
        self._record(name, now, time.process_time())

    def mark_split(self, first: str, first_part: TimedIterator, rest: str) -> None:
        """End two stages at once, when the time since the last mark interleaved two kinds of
        work: `first` is what `first_part` measured of it, `rest` the remainder."""
        now, cpu = max(time.time(), self._last), time.process_time()
        seconds = min(first_part.seconds, now - self._last)
        self._record(first, self._last + seconds, self._last_cpu + first_part.cpu_seconds)
        self._record(rest, now, cpu)

    def _record(self, name: str, ended_at: float, cpu: float) -> None:
        stage = Stage(name, ended_at - self._last, max(cpu - self._last_cpu, 0.0), ended_at)
        self.stages.append(stage)
        self._last, self._last_cpu = ended_at, cpu
        logger.info(LOG_FORMAT, name, stage.seconds, stage.cpu_seconds)

    @property
    def total_s(self) -> float:
        return self._last - self.started_at

    def to_dict(self) -> dict[str, Any]:
        """What /get_server_info reports: the stages in order and their whole (seconds), and
        the epoch seconds the first started (to line up two processes' stages)."""
        return {
            "process": self.process,
            "started_at": self.started_at,
            "stages": [
                {"name": s.name, "seconds": round(s.seconds, 3), "cpu_s": round(s.cpu_seconds, 3)}
                for s in self.stages
            ],
            "total_s": round(self.total_s, 3),
        }

    def log_summary(self) -> None:
        logger.info(
            "%s start-up: %.2f s (%s)",
            self.process,
            self.total_s,
            ", ".join(f"{s.name} {s.seconds:.2f}" for s in self.stages),
        )


class TimedIterator(Iterator[T]):
    """Iterates `items`, adding up the seconds (and CPU seconds) spent producing them: the
    share of a loop that went to its source rather than to its body."""

    def __init__(self, items: Iterable[T]) -> None:
        self._items = iter(items)
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def __next__(self) -> T:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return next(self._items)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.process_time() - cpu
