"""The server's one worker: a thread that owns the model, a
:class:`kvcandle.BatchGenerator` and the :class:`kvcandle.PromptCache`, and runs every
admitted request's sequences together, one batched step at a time (continuous
batching). Requests wait in a bounded queue; a full queue refuses at once. A cancelled
job (its client went away) leaves the batch before the next step, so its work stops
within one decode step or prefill chunk.

No web framework here: a job reports its events through a callback the app gives it.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..generation import BatchGenerator, GenerationResult
from ..model import Model
from ..prompt_cache import PromptCache

#: seconds of generated tokens the tokens-per-second figure is measured over
RATE_WINDOW = 10.0
#: the prompt cache is saved when the worker is idle, at most this often (and at stop)
SAVE_INTERVAL = 5.0


class QueueFull(Exception):
    """The queue holds ``max_queue`` jobs already."""


@dataclass
class Job:
    """One request's sequences: a prompt (or several) and its settings, ``n`` each.

    ``emit`` is called from the worker thread with ``("piece", choice, Piece)`` as text
    comes out (a choice's last piece carries its result), ``("error", None, message)``
    if the job cannot run, and ``("end", None, None)`` when it is over.
    """

    prompts: list[list[int]]
    n: int
    max_tokens: list[int]
    settings: dict[str, Any]
    logprobs: Optional[int]
    emit: Callable[[str, Optional[int], Any], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    # the worker's: sequence id in the batch -> choice index
    uids: dict[int, int] = field(default_factory=dict)

    @property
    def sequences(self) -> int:
        return len(self.prompts) * self.n

    def cancel(self) -> None:
        """Stops the job's work before the next step (from any thread)."""
        self.cancelled.set()


@dataclass
class Counters:
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    prompt_tokens_run: int = 0
    """Prompt tokens actually run (cancelled prompts count only what ran)."""
    cached_tokens: int = 0
    prompt_cache_hits: int = 0
    generated_tokens: int = 0
    steps: int = 0


class Scheduler:
    """Runs jobs on ``model`` in one thread; see the module's description."""

    def __init__(
        self, model: Model, *, max_batch: int, max_queue: int, prompt_cache_bytes: int, prompt_cache_dir: Optional[Path] = None
    ) -> None:
        self.model = model
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prompt_cache_dir = prompt_cache_dir
        if prompt_cache_dir is not None:
            self.prompt_cache = PromptCache.load(prompt_cache_dir, model, prompt_cache_bytes)
        else:
            self.prompt_cache = PromptCache(model, prompt_cache_bytes)
        self.counters = Counters()
        self._batch = BatchGenerator(model)
        self._queue: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._lock = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._rate: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self._dirty = False  # the prompt cache changed since it was saved
        self._saved_at = 0.0

    # -- any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvcandle-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the worker after its current step (cancelling every job) and saves the
        prompt cache if it has a directory."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._save(force=True)

    def submit(self, job: Job) -> None:
        """Queues ``job``.

        Raises:
            QueueFull: ``max_queue`` jobs would wait already (jobs the batch has room
                for join it at the worker's next step, and do not count).
        """
        with self._lock:
            waiting = self._waiting_with(job)
            if waiting > self.max_queue:
                self.counters.rejected += 1
                raise QueueFull(f"the server is busy: {waiting - 1} requests are waiting (--max-queue {self.max_queue}); try again later")
            self.counters.requests += 1
            self._queue.append(job)
            self._lock.notify_all()

    def cancel(self, job: Job) -> None:
        """Stops ``job``'s work before the next step (from any thread); its events end
        with ``"end"``."""
        job.cancel()
        with self._lock:
            self._lock.notify_all()

    def stats(self) -> dict[str, Any]:
        """What /health and /metrics show."""
        with self._lock:
            now = time.perf_counter()
            window = [(t, k) for t, k in self._rate if now - t <= RATE_WINDOW]
            tps = 0.0
            if window:
                span = max(now - window[0][0], 1e-9)
                tps = sum(k for _, k in window) / max(span, 1.0)
            c = self.counters
            return {
                "requests_running": len(self._running),
                "requests_queued": len(self._queue),
                "batch_size": len(self._batch),
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
                "tokens_per_second": round(tps, 2),
                "prompt_cache_entries": len(self.prompt_cache),
                "prompt_cache_bytes": self.prompt_cache.nbytes,
                "prompt_cache_max_bytes": self.prompt_cache.max_bytes,
                "requests_total": c.requests,
                "requests_finished_total": c.finished,
                "requests_cancelled_total": c.cancelled,
                "requests_rejected_total": c.rejected,
                "requests_failed_total": c.failed,
                "prompt_tokens_total": c.prompt_tokens,
                "prompt_tokens_run_total": c.prompt_tokens_run,
                "cached_tokens_total": c.cached_tokens,
                "prompt_cache_hits_total": c.prompt_cache_hits,
                "generated_tokens_total": c.generated_tokens,
                "steps_total": c.steps,
            }

    # -- the worker ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._queue and not self._running:
                    if self._dirty:
                        break
                    self._lock.wait()
                if self._stopping:
                    break
                admitted = self._admit()
            for job in admitted:
                self._start(job)
            self._drop_cancelled()
            if self._batch:
                self._step()
            elif self._dirty and not self._queue:
                self._save(force=False)
                with self._lock:
                    if self._dirty and not self._queue and not self._stopping:
                        self._lock.wait(SAVE_INTERVAL)
        for job in list(self._running) + list(self._queue):
            job.cancel()
        self._drop_cancelled()
        for job in self._queue:
            job.emit("end", None, None)

    def _waiting_with(self, new: Job) -> int:
        """How many of the queued jobs and ``new`` would still wait after the worker's
        next admission (:meth:`_admit`'s rule; with the lock held)."""
        used, running, waiting = sum(j.sequences for j in self._running), bool(self._running), 0
        for job in [*self._queue, new]:
            if job.cancelled.is_set():
                continue
            if waiting or (used + job.sequences > self.max_batch and running):
                waiting += 1
            else:
                used, running = used + job.sequences, True
        return waiting

    def _admit(self) -> list[Job]:
        """Jobs taken from the queue, in order, while their sequences fit the batch
        (with the lock held)."""
        admitted = []
        used = sum(j.sequences for j in self._running)
        while self._queue:
            job = self._queue[0]
            if job.cancelled.is_set():
                self._queue.popleft()
                self.counters.cancelled += 1
                job.emit("end", None, None)
                continue
            if used + job.sequences > self.max_batch and self._running:
                break
            self._queue.popleft()
            used += job.sequences
            self._running.append(job)
            admitted.append(job)
        return admitted

    def _start(self, job: Job) -> None:
        try:
            for p, ids in enumerate(job.prompts):
                settings = dict(job.settings)
                seed = settings.pop("seed")
                if seed is not None:
                    seed += p * job.n
                uids = self._batch.add(
                    ids, n=job.n, max_tokens=job.max_tokens[p], seed=seed, prompt_cache=self.prompt_cache, logprobs=job.logprobs, **settings
                )
                for j, uid in enumerate(uids):
                    job.uids[uid] = p * job.n + j
        except Exception as e:  # checked before it was queued; a failure here is reported, never raised
            for uid in job.uids:
                self._batch.remove(uid)
            job.uids.clear()
            self._finish(job, failed=True)
            job.emit("error", None, str(e))
            job.emit("end", None, None)
            return
        with self._lock:
            self.counters.prompt_tokens += sum(len(ids) for ids in job.prompts)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._running if j.cancelled.is_set()]:
            for uid in list(job.uids):
                result = self._batch.remove(uid)
                self._count(job, uid, result)
            self._finish(job, cancelled=True)
            job.emit("end", None, None)

    def _step(self) -> None:
        owners = {uid: job for job in self._running for uid in job.uids}
        try:
            pieces = self._batch.step()
        except Exception as e:  # every cache is consistent after a failed step: end the jobs, keep the worker
            for job in list(self._running):
                for uid in list(job.uids):
                    self._batch.remove(uid)
                self._finish(job, failed=True)
                job.emit("error", None, f"generation failed: {e}")
                job.emit("end", None, None)
            return
        generated = 0
        for piece in pieces:
            job = owners[piece.index]
            generated += len(piece.tokens)
            if piece.result is not None:
                self._count(job, piece.index, piece.result)
            job.emit("piece", job.uids[piece.index], piece)
            if piece.result is not None:
                del job.uids[piece.index]
                if not job.uids:
                    self._finish(job)
                    job.emit("end", None, None)
        with self._lock:
            self.counters.steps += 1
            now = time.perf_counter()
            self._rate.append((now, generated))
            while self._rate and now - self._rate[0][0] > RATE_WINDOW:
                self._rate.popleft()

    def _count(self, job: Job, uid: int, result: GenerationResult) -> None:
        """A sequence's counts, once it is over (finished or removed)."""
        s = result.stats
        first = job.uids[uid] % job.n == 0  # the prompt ran for the first of its n
        with self._lock:
            self.counters.generated_tokens += len(result.tokens)
            if first:
                ran = s.prefill_tokens if result.finish_reason != "removed" or result.cache is None else max(len(result.cache) - s.reused_tokens, 0)
                self.counters.prompt_tokens_run += min(ran, s.prefill_tokens)
                self.counters.cached_tokens += s.reused_tokens
                self.counters.prompt_cache_hits += s.reused_tokens > 0
        self._dirty = self.prompt_cache_dir is not None

    def _finish(self, job: Job, *, cancelled: bool = False, failed: bool = False) -> None:
        with self._lock:
            if job in self._running:
                self._running.remove(job)
            if cancelled:
                self.counters.cancelled += 1
            elif failed:
                self.counters.failed += 1
            else:
                self.counters.finished += 1

    def _save(self, *, force: bool) -> None:
        if self.prompt_cache_dir is None or not self._dirty:
            return
        if not force and time.perf_counter() - self._saved_at < SAVE_INTERVAL:
            return
        try:
            self.prompt_cache.save(self.prompt_cache_dir)
        except Exception:  # noqa: BLE001 (the worker's thread must go on)
            pass  # a full disk or a bad directory loses the saved copy, never the server
        self._dirty = False
        self._saved_at = time.perf_counter()

