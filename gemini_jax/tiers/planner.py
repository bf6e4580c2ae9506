"""Prefetch planning beside the decode step, not on its path.

A decode step over tiers hands the prefetcher guesses (a lookahead selection in the middle of the
one-program step; after it, the history of what each layer read and the next step's guesses).
Turning a guess into fetches (block tables to page keys, dropping pages already in a slot or
never stored below, scheduling reads) is host work the device need not wait for. `Planner` runs
those jobs in order on one background thread: the step's thread (and the device program's
callbacks) only hand them over.

Ordering: jobs run one at a time in the order submitted, so the predictor sees observe /
speculate / predict in the step's order; whoever reads the predictor on its own thread calls
`settle()` first. A page a job schedules is read from below when the read runs, and a page
rewritten in between is unstaged by `Prefetcher.invalidate` (synchronous, on the step's thread),
so a late plan may waste a read but never stages stale bytes.

Errors: a job that raises stops planning (later jobs are skipped: they would build on a state the
failure left half-updated); the error is raised to the step's thread by the next `submit`,
`check` or `settle`.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional


class Planner:
    """Jobs run in submission order on one thread (`background`), or at once on the caller's."""

    def __init__(self, *, background: bool = True):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gj-plan") if background else None
        self._last: Optional[Future] = None
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self.jobs = 0  # submitted (for tests and counters)

    @property
    def background(self) -> bool:
        return self._pool is not None

    def _run(self, fn: Callable, args: tuple) -> None:
        with self._lock:
            if self._error is not None:
                return
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the step's thread by `check`
            with self._lock:
                self._error = err

    def submit(self, fn: Callable, *args) -> None:
        """Run `fn(*args)` after every job submitted before it. Raises a failed earlier job's error."""
        self.check()
        self.jobs += 1
        if self._pool is None:
            fn(*args)
            return
        self._last = self._pool.submit(self._run, fn, args)

    def check(self) -> None:
        """Raise (once) the error of a job that failed."""
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def settle(self) -> None:
        """Wait for every job submitted so far, then `check`."""
        last = self._last
        if last is not None:
            last.result()
        self.check()

    def close(self) -> None:
        """Finish the queued jobs and stop the thread (a failed job's error is dropped: closing)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
