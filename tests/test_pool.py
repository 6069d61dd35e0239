"""The coordinator's worker pool: lazily started threads, FIFO, a clean shutdown."""

from __future__ import annotations

import queue
import threading

from rxcoord._core.workers import WorkerPool, hand_off


def test_runs_work_on_at_most_max_workers_threads() -> None:
    pool = WorkerPool(3, "rxcoord-pool-test")
    names: set[str] = set()
    done = threading.Semaphore(0)
    lock = threading.Lock()

    def work() -> None:
        with lock:
            names.add(threading.current_thread().name)
        done.release()

    for _ in range(50):
        pool.submit(work)
    for _ in range(50):
        assert done.acquire(timeout=10)
    assert 1 <= len(names) <= 3
    pool.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("rxcoord-pool-test")]


def test_a_submit_racing_shutdown_is_never_stranded_behind_the_exit_markers() -> None:
    class SlowQueue(queue.SimpleQueue[object]):
        def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
            if item is not None:
                threading.Event().wait(0.2)  # a window for shutdown() to slip in
            super().put(item)

    pool = WorkerPool(1, "rxcoord-pool-race")
    ran = threading.Event()
    pool.submit(lambda: None)  # start the worker
    pool._queue = SlowQueue()  # type: ignore[assignment]
    submitter = threading.Thread(target=pool.submit, args=(ran.set,))
    submitter.start()
    threading.Event().wait(0.05)
    pool.shutdown(wait=False)
    submitter.join()
    # The worker still waits on the old queue; drain the new one as a worker would.
    old_thread = pool._threads[0]
    item = pool._queue.get(timeout=5)
    assert item is not None  # the job came before the exit marker
    item()
    assert ran.is_set()
    del old_thread


def test_hand_off_runs_elsewhere_and_logs_failures() -> None:
    seen: list[str] = []
    done = threading.Event()

    def record() -> None:
        seen.append(threading.current_thread().name)
        done.set()

    hand_off(lambda: 1 / 0)
    hand_off(record)
    assert done.wait(10)
    assert seen[0].startswith("rxcoord-deliver")


def test_jobs_that_wait_on_each_other_always_find_a_worker() -> None:
    # Up to max_workers jobs in flight each get a thread, also after many finished jobs (the
    # workers count their ends without a lock: the count may lag, never lead).
    pool = WorkerPool(3, "rxcoord-pool-chain")
    done = threading.Semaphore(0)
    for _ in range(500):  # one at a time: one or two workers are all these need
        pool.submit(done.release)
        assert done.acquire(timeout=10)
    for _ in range(20):
        first, second, third = threading.Event(), threading.Event(), threading.Event()
        pool.submit(lambda a=first, b=second: (a.wait(10), b.set()))  # type: ignore[misc]
        pool.submit(lambda b=second, c=third: (b.wait(10), c.set()))  # type: ignore[misc]
        pool.submit(first.set)
        assert third.wait(10), "a job waited behind a busy pool"
    assert pool.threads <= 3
    pool.shutdown()
