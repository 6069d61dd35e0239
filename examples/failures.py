"""Failures in ``serialize_by_key``: isolate them per item, or stop and wait for the work.

``serialize_by_key`` is fail-fast like ``flat_map``: one failed inner ends the whole stream. This
example shows the three things to do about it (the README's recipes):

1. **Drop failed items** - catch inside the inner and continue with ``empty()``: the stream
   lives on, the failures vanish (only acceptable when something else reports them).
2. **Errors as values** - catch inside the inner and emit a ``Failed(item, error)`` value: the
   stream lives on and every item comes out, as a result or as its failure.
3. **Fail fast, then wait** - let the error end the stream. The operator disposes the active
   inners, but disposing cannot stop a thread: their work may still be running. Give the
   pipeline an executor of its own and shut it down (``wait=True``) before reusing the keys
   (or the resources the work touches).

Run: ``python examples/failures.py``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import reactivex
from reactivex import Observable
from reactivex import operators as ops
from reactivex.scheduler import ThreadPoolScheduler

from rxcoord import serialize_by_key


@dataclass(frozen=True)
class Message:
    customer: str
    seq: int


@dataclass(frozen=True)
class Failed:
    """An item whose handler failed, with the error: a value of the stream, not its end."""

    item: Message
    error: Exception


MESSAGES = [Message(f"customer-{i % 4}", i // 4) for i in range(40)]


def is_bad(m: Message) -> bool:
    return m.seq == 3 and m.customer in ("customer-1", "customer-2")


def drop_failed(pool: ThreadPoolScheduler) -> None:
    def handle(m: Message) -> Observable[Message]:
        def work() -> Message:
            if is_bad(m):
                raise ValueError(f"cannot handle {m}")
            return m

        return reactivex.from_callable(work, scheduler=pool)

    def isolated(m: Message) -> Observable[Message]:
        return handle(m).pipe(ops.catch(lambda err, _: reactivex.empty()))

    out = (
        reactivex.from_iterable(MESSAGES)
        .pipe(serialize_by_key(lambda m: m.customer, isolated), ops.to_list())
        .run()
    )
    gone = len(MESSAGES) - len(out)
    print(f"1. drop failed items: {len(out)} of {len(MESSAGES)} came out; {gone} failures vanished")


def errors_as_values(pool: ThreadPoolScheduler) -> None:
    def handle(m: Message) -> Observable[Message]:
        def work() -> Message:
            if is_bad(m):
                raise ValueError(f"cannot handle {m}")
            return m

        return reactivex.from_callable(work, scheduler=pool)

    def safely(m: Message) -> Observable[Message | Failed]:
        # The failure becomes this item's value; the key's next item runs as usual.
        result: Observable[Message | Failed] = handle(m)
        return result.pipe(ops.catch(lambda err, _: reactivex.just(Failed(m, err))))

    out: list[Message | Failed] = (
        reactivex.from_iterable(MESSAGES)
        .pipe(serialize_by_key(lambda m: m.customer, safely), ops.to_list())
        .run()
    )
    failed = [r for r in out if isinstance(r, Failed)]
    print(
        f"2. errors as values: {len(out)} of {len(MESSAGES)} came out, {len(failed)} of them "
        f"Failed: {', '.join(sorted(f'{f.item.customer}#{f.item.seq}' for f in failed))}"
    )


def fail_fast_then_wait() -> None:
    # The pipeline's own executor: shutting it down after the error both waits for the work
    # still running and refuses work that an inner might still try to start (an item whose
    # turn came on another thread at the moment of the error).
    executor = ThreadPoolExecutor(4, thread_name_prefix="handlers")
    lock = threading.Lock()
    running = 0

    def work(m: Message) -> Message:
        nonlocal running
        with lock:
            running += 1
        try:
            if is_bad(m):
                raise ValueError(f"cannot handle {m}")
            time.sleep(0.05)  # the other keys' work is slower than the failure
            return m
        finally:
            with lock:
                running -= 1

    def handle(m: Message) -> Observable[Message]:
        # Submitted when the item's turn comes (defer), not when the operator receives it.
        return reactivex.defer(lambda _: reactivex.from_future(executor.submit(work, m)))

    try:
        reactivex.from_iterable(MESSAGES).pipe(
            serialize_by_key(lambda m: m.customer, handle), ops.to_list()
        ).run()
    except ValueError as error:
        with lock:
            still = running
        print(f"3. fail fast: the stream ended with {error!r}")
        print(f"   handlers of disposed inners still running when the error arrived: {still}")
        executor.shutdown(wait=True)  # from here on no handler runs: the keys are safe to reuse
        print(f"   after executor.shutdown(wait=True): {running} running")
    else:
        executor.shutdown()
        raise SystemExit("the failure did not end the stream")


def main() -> None:
    pool = ThreadPoolScheduler(4)
    try:
        drop_failed(pool)
        errors_as_values(pool)
    finally:
        pool.executor.shutdown()
    fail_fast_then_wait()


if __name__ == "__main__":
    main()
