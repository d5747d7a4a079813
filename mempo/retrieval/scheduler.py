"""Scheduling of search requests: one bounded queue, micro-batches, deadlines, hang-ups.

    batcher = MicroBatcher(retriever.search, max_queries=128, max_queue_queries=1024)
    batcher.start()                                    # on the server's event loop
    future = batcher.submit(["Grasdrior Labs"], topk=3, timeout_s=10)   # or Overloaded
    hits = await await_answer(request, future, 10)     # or DeadlineExceeded / ClientGone

`mempo.retrieval.server` turns Overloaded and DeadlineExceeded into 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mempo.retrieval.base import Hit

if TYPE_CHECKING:
    from starlette.requests import Request

MAX_RETRY_AFTER_S = 30


class Overloaded(Exception):
    """The queue is full: answer 503 and ask the client to come back in `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    """A request waited longer than `request_timeout_s`; it is not (or no longer) searched."""


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


@dataclass(eq=False)
class _Job:
    queries: list[str]
    topk: int
    future: asyncio.Future[list[list[Hit]]]
    enqueued: float  # loop.time()
    deadline: float  # loop.time()


def search_threads(workers: int) -> ThreadPoolExecutor:
    """The pool whose threads run the searches (`workers` of them, started on first use)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mempo-search")


class MicroBatcher:
    """A bounded queue of search requests served by `workers` threads, batch by batch.

    A free worker takes everything waiting (up to `max_queries` queries; one request when
    `batching` is off) and runs `search_fn` on it. So a request that finds the workers idle
    is searched at once, and requests that arrive while they are busy share the next call:
    batches grow with the load, not with a timer. `window_s` > 0 makes a lone request wait
    that long for company first (trading latency for batch size).

    All methods run on the event loop (no locks); only `search_fn` runs in the threads.
    """

    def __init__(self, search_fn: Callable[[list[str], int], list[list[Hit]]], *,
                 max_queries: int, max_queue_queries: int, workers: int = 1,
                 batching: bool = True, window_s: float = 0.0,
                 on_batch: Callable[[int], None] | None = None,
                 on_drop: Callable[[str], None] | None = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.search_fn = search_fn
        self.max_queries = max_queries
        self.max_queue_queries = max_queue_queries
        self.workers = workers
        self.batching = batching
        self.window_s = window_s
        self.on_batch = on_batch
        self.on_drop = on_drop
        self.queued_queries = 0  # waiting, not yet taken by a worker
        self.running_queries = 0
        self.busy = 0
        self.seconds_per_query = 0.01  # running estimate, for Retry-After
        self._waiting: deque[_Job] = deque()
        # `executor`: the threads that opened the index (mempo.retrieval.serving.open_in_search_thread);
        # the batcher owns it from here on and shuts it down in stop()
        self._pool = executor or search_threads(workers)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Let queued and running batches finish (up to `timeout_s`), then free the threads."""
        deadline = time.monotonic() + timeout_s
        while (self._waiting or self.busy) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def retry_after_s(self) -> int:
        """Whole seconds until the current backlog should have drained (1 to 30)."""
        backlog = self.queued_queries + self.running_queries
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(
            backlog * self.seconds_per_query / self.workers))))

    def submit(self, queries: list[str], topk: int, timeout_s: float) -> asyncio.Future[list[list[Hit]]]:
        """Queue a request; its future gets the hits. Raises Overloaded when the queue is full."""
        assert self._loop is not None, "MicroBatcher.start() first"
        if self.queued_queries + len(queries) > self.max_queue_queries:
            raise Overloaded(f"the server is at capacity ({self.queued_queries} queries queued, "
                             f"limit {self.max_queue_queries}); retry later", self.retry_after_s())
        now = self._loop.time()
        job = _Job(queries, topk, self._loop.create_future(), now, now + timeout_s)
        self._waiting.append(job)
        self.queued_queries += len(queries)
        self._pump()
        return job.future

    def _pop(self) -> _Job:
        job = self._waiting.popleft()
        self.queued_queries -= len(job.queries)
        return job

    def _take(self) -> list[_Job]:
        """The next batch, skipping requests whose client left or whose deadline passed."""
        assert self._loop is not None
        now = self._loop.time()
        batch: list[_Job] = []
        n = 0
        while self._waiting:
            job = self._waiting[0]
            if job.future.done():  # cancelled: the client hung up or its wait timed out
                self._pop()
                if self.on_drop:
                    self.on_drop("cancelled")
                continue
            if job.deadline <= now:
                self._pop()
                job.future.set_exception(DeadlineExceeded())
                if self.on_drop:
                    self.on_drop("deadline")
                continue
            if batch and (not self.batching or n + len(job.queries) > self.max_queries):
                break
            batch.append(self._pop())
            n += len(job.queries)
        return batch

    def _pump(self) -> None:
        """Start batches while a worker is free and requests wait."""
        assert self._loop is not None
        while self.busy < self.workers and self._waiting:
            if self.window_s > 0 and self.queued_queries < self.max_queries:
                wake = self._waiting[0].enqueued + self.window_s
                if self._loop.time() < wake:
                    if self._timer is None:
                        self._timer = self._loop.call_at(wake, self._on_timer)
                    return
            batch = self._take()
            if not batch:
                return
            self.busy += 1
            task = self._loop.create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _on_timer(self) -> None:
        self._timer = None
        if self._waiting:
            self._waiting[0].enqueued = -math.inf  # its wait is over, whoever joined
        self._pump()

    async def _run(self, batch: list[_Job]) -> None:
        assert self._loop is not None
        queries = [q for job in batch for q in job.queries]
        k = max(job.topk for job in batch)
        self.running_queries += len(queries)
        if self.on_batch:
            self.on_batch(len(queries))
        t = time.perf_counter()
        try:
            results = await self._loop.run_in_executor(self._pool, self.search_fn, queries, k)
        except Exception as e:  # noqa: BLE001 - handed to every waiting request
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(e)
        else:
            per_query = (time.perf_counter() - t) / len(queries)
            self.seconds_per_query = 0.8 * self.seconds_per_query + 0.2 * per_query
            i = 0
            for job in batch:
                part = results[i : i + len(job.queries)]
                i += len(job.queries)
                if not job.future.done():
                    job.future.set_result([hits[: job.topk] for hits in part])
        finally:
            self.busy -= 1
            self.running_queries -= len(queries)
            self._pump()


async def _client_gone(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def await_answer(request: Request, future: asyncio.Future[Any], timeout_s: float) -> Any:
    """The future's result; ClientGone if the client hangs up first, DeadlineExceeded after
    `timeout_s`. Either way the future is cancelled, so a queued request is never searched."""
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait((future, gone), timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if future.done():
        return future.result()
    future.cancel()
    if gone in done:
        raise ClientGone()
    raise DeadlineExceeded()
