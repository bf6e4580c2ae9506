"""The thread that runs a `Scheduler` for the server: requests come in from the event loop's
thread, tokens go out through each request's sink; the engine is only ever touched here."""

from __future__ import annotations

import logging
import queue
import threading
import traceback

from gemini_jax.serve.request import Request
from gemini_jax.serve.scheduler import Scheduler

log = logging.getLogger("gemini_jax.serve")


class Worker:
    """`submit` and `cancel` are safe from any thread; `close` stops the thread after cancelling
    what is still queued or running."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.lock = threading.Lock()  # held around each step: readers of scheduler state take it
        self._thread = threading.Thread(target=self._run, name="gemini_jax-scheduler", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        """Queue a request already checked with `scheduler.check` (it joins at the next step)."""
        self._inbox.put(req)
        self._wake.set()

    def cancel(self, req: Request) -> None:
        """End `req` at the next step boundary (its pages go back to the pool)."""
        req.cancel_requested = True
        self._wake.set()

    def interrupt(self, req: Request) -> None:
        """Stop `req` at its next token boundary, keeping its state for a resume."""
        req.interrupt_requested = True
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        sched = self.scheduler
        while not self._stop.is_set():
            with self.lock:
                while True:
                    try:
                        sched.submit(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                try:
                    worked = sched.step()
                except Exception as err:  # noqa: BLE001 - one bad step must not kill the server
                    log.error("scheduler step failed: %s\n%s", err, traceback.format_exc())
                    sched.fail_all(f"{type(err).__name__}: {err}")
                    worked = False
            if not worked:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
        with self.lock:
            sched.close()
