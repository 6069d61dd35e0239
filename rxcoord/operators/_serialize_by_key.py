"""The keyed serialization operator: a thin Rx adapter over the lane table.

Why not compose it from RxPY's own operators? ``group_by`` + ``flat_map`` + ``concat_map`` keeps
every group forever (a leak with distinct keys) and pays several operator layers per item, and
the two building blocks that would give a concurrency cap are not thread-safe in reactivex 6.1:

* ``merge(max_concurrent)`` reads its active count and appends to its queue without a lock, so
  an inner that completes on another thread at that moment leaves the queued inner never
  subscribed and the stream completes without it (a silent loss);
* a ``Subject`` calls its observers outside its lock, so emissions from several threads overlap
  downstream and can even follow ``on_completed``.

So each subscription keeps one lock around a :class:`~rxcoord._core.lanes.LaneTable` (per-key
lanes, the ready FIFO over the cap: the same table the coordinator and the Kafka consumer order
their work with), and this module adds only what is Rx: subscribing inners, serializing what goes
downstream, and tearing down. User code (key_mapper, mapper, inner subscriptions and the
downstream observer) is never called with the lock held.

Downstream calls are serialized without blocking: whoever finds the observer idle delivers,
everyone else appends to a queue the deliverer drains (the "emitter loop" of RxJava's
``SerializedObserver``). No thread ever waits for another one's ``on_next`` to return, so a slow
or re-entrant subscriber cannot deadlock the operator.

Inners that terminate synchronously inside their own ``subscribe`` would otherwise recurse
(inner n completes -> subscribe n+1 -> completes -> ...) and hit the recursion limit on a long
queue; a per-thread trampoline turns that recursion into a loop.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Final, Generic, TypeVar

from reactivex import Observable, abc, from_future
from reactivex.disposable import Disposable, SingleAssignmentDisposable
from reactivex.internal.utils import is_future

from .._core.checks import check_cap
from .._core.lanes import LaneTable

__all__ = ["serialize_by_key"]

_T = TypeVar("_T")
_R = TypeVar("_R")


class _Finished(abc.DisposableBase):
    """Marker stored in ``_Lane.sub`` once the lane's inner has terminated."""

    __slots__ = ()

    def dispose(self) -> None:  # pragma: no cover - never disposed, only compared
        pass


_FINISHED: Final = _Finished()
_COMPLETED: Final = object()  # the terminal notification "completed" in ``_Sink._terminal``


def serialize_by_key(
    key_mapper: Callable[[_T], Hashable],
    mapper: Callable[[_T], abc.ObservableBase[_R]],
    *,
    max_concurrent: int | None = None,
) -> Callable[[Observable[_T]], Observable[_R]]:
    """Project each item to an inner Observable; run inners of equal keys one after another.

    Items whose keys are equal are processed strictly in source order, one at a time: the inner
    of item n+1 is subscribed only after the inner of item n terminated. Inners of different
    keys run concurrently, at most ``max_concurrent`` of them at once; ready work over the cap
    starts in the order it became ready, so no key starves. The output carries every inner
    emission, serialized, and completes once the source completed and every inner terminated::

        source:  --a1--b1--a2----------|
        inner a1:  ----x|
        inner b1:      --y|
        inner a2:          (waits)--z|      a2 starts only after a1 completed
        output:  ------x---y-------z-|

    Per-key state lives only while a key has an active or queued item, so a stream of distinct
    keys keeps memory flat (``group_by`` keeps every group forever).

    Errors are fail-fast like ``flat_map``: an error from the source, ``key_mapper``, ``mapper``
    or an inner terminates the output with that exception object and disposes active inners.
    To isolate failures per item, catch inside the inner::

        serialize_by_key(key, lambda m: handle(m).pipe(ops.catch(lambda e, _: reactivex.empty())))

    Disposing the subscription disposes every active inner and drops queued items (they are
    never subscribed). Source emissions, inner emissions and terminations may arrive on any
    threads; the downstream observer is never called concurrently.

    Args:
        key_mapper: Returns the (hashable) ordering key of an item.
        mapper: Returns the inner Observable for an item (a Future is accepted too). Called
            when the item's turn comes, not when it arrives.
        max_concurrent: Most inners active at once across all keys; ``None`` for no limit.

    Returns:
        An operator function for ``Observable.pipe``.

    Raises:
        TypeError: ``key_mapper`` or ``mapper`` is not callable, or ``max_concurrent`` is not an
            int (or None).
        ValueError: ``max_concurrent`` is less than 1.
    """
    # Checked here, not at subscribe: a pipeline is often built long before it is subscribed,
    # and the error then points at the line that built it.
    _check_callable("key_mapper", key_mapper)
    _check_callable("mapper", mapper)
    cap = check_cap(max_concurrent, "max_concurrent")

    def operator(source: Observable[_T]) -> Observable[_R]:
        def subscribe(
            observer: abc.ObserverBase[_R], scheduler: abc.SchedulerBase | None = None
        ) -> abc.DisposableBase:
            return _Sink(observer, scheduler, key_mapper, mapper, cap).run(source)

        return Observable(subscribe)

    return operator


def _check_callable(name: str, value: object) -> None:
    if not callable(value):
        raise TypeError(
            f"serialize_by_key: {name} must be a callable, not {type(value).__name__} ({value!r})"
        )


class _Lane(abc.ObserverBase[_R], Generic[_T, _R]):
    """One source item in its key's lane, and the observer of its inner once it starts.

    Each inner subscription has an observer of its own, so a late disposable can never be
    confused with its successor's. After its terminal notification it ignores whatever a
    misbehaving inner still sends (it is the inner's auto-detaching observer).
    """

    __slots__ = ("item", "key", "sink", "sub")

    def __init__(self, sink: _Sink[_T, _R], key: Hashable, item: _T) -> None:
        self.sink = sink
        self.key = key
        self.item: _T | None = item  # dropped once the inner is subscribed
        self.sub: abc.DisposableBase | None = None  # None until subscribed, then _FINISHED

    def on_next(self, value: _R) -> None:
        if self.sub is not _FINISHED:
            self.sink.emit(value)

    def on_error(self, error: Exception) -> None:
        if self.sub is not _FINISHED:
            self.sink.fail(error)

    def on_completed(self) -> None:
        if self.sub is not _FINISHED:
            self.sink.lane_completed(self)


class _Trampoline(threading.local):
    """Per-thread queue of lanes to subscribe, and whether the thread is subscribing."""

    def __init__(self) -> None:  # once per thread: one queue each, reused for every start
        self.active = False
        self.queue: deque[Any] = deque()


class _Sink(Generic[_T, _R]):
    """The state of one subscription to a ``serialize_by_key`` Observable."""

    __slots__ = (
        "_done",
        "_emitting",
        "_key_mapper",
        "_lanes",
        "_lock",
        "_mapper",
        "_observer",
        "_queue",
        "_scheduler",
        "_source_done",
        "_source_sub",
        "_terminal",
        "_trampoline",
    )

    def __init__(
        self,
        observer: abc.ObserverBase[_R],
        scheduler: abc.SchedulerBase | None,
        key_mapper: Callable[[_T], Hashable],
        mapper: Callable[[_T], abc.ObservableBase[_R]],
        cap: int,
    ) -> None:
        self._observer = observer
        self._scheduler = scheduler
        self._key_mapper = key_mapper
        self._mapper = mapper
        self._lock = threading.Lock()
        self._lanes: LaneTable[Hashable, _Lane[_T, _R]] = LaneTable(cap)
        self._source_done = False
        self._done = False  # terminated or disposed: no more work, no more state
        self._emitting = False  # a thread is delivering to the observer
        self._queue: list[_R] = []  # emissions waiting for the delivering thread
        self._terminal: object = None  # _COMPLETED or an exception, once decided
        self._source_sub = SingleAssignmentDisposable()
        self._trampoline = _Trampoline()

    def run(self, source: Observable[_T]) -> abc.DisposableBase:
        self._source_sub.disposable = source.subscribe(
            self._on_source_next,
            self._on_source_error,
            self._on_source_completed,
            scheduler=self._scheduler,
        )
        return Disposable(self._dispose)

    # -- source side -------------------------------------------------------------------------

    def _on_source_next(self, item: _T) -> None:
        try:
            key = self._key_mapper(item)
            hash(key)  # an unhashable key is the key_mapper's error, reported as such
        except Exception as exc:
            self.fail(exc)
            return
        lane = _Lane(self, key, item)
        with self._lock:
            if self._done:
                return
            start = self._lanes.add(key, lane)
        if start:
            self._start(lane)

    def _on_source_error(self, error: Exception) -> None:
        self.fail(error)

    def _on_source_completed(self) -> None:
        with self._lock:
            if self._done:
                return
            self._source_done = True
            if not self._lanes.idle:
                return
            deliver = self._terminate(_COMPLETED)
        if deliver:
            self._deliver()

    # -- inner side --------------------------------------------------------------------------

    def lane_completed(self, lane: _Lane[_T, _R]) -> None:
        deliver = False
        with self._lock:
            if self._done:
                return
            finished = lane.sub  # its subscription, if subscribe() has returned already
            lane.sub = _FINISHED
            start = self._lanes.finish(lane.key)
            if start is None and self._source_done and self._lanes.idle:
                deliver = self._terminate(_COMPLETED)
        if finished is not None:
            finished.dispose()
        if start is not None:
            self._start(start)
        elif deliver:
            self._deliver()

    def _start(self, lane: _Lane[_T, _R]) -> None:
        """Subscribe ``lane``'s inner; on re-entry from a synchronous inner, defer to the loop."""
        trampoline = self._trampoline
        queue = trampoline.queue
        if trampoline.active:
            queue.append(lane)
            return
        trampoline.active = True
        try:
            while True:
                self._subscribe_inner(lane)
                if not queue:
                    return
                lane = queue.popleft()
        finally:
            trampoline.active = False
            queue.clear()  # left over only if a start raised: those lanes die with the sink

    def _subscribe_inner(self, lane: _Lane[_T, _R]) -> None:
        if self._done:  # torn down while this lane waited in the trampoline
            return
        item = lane.item
        lane.item = None
        try:
            inner: Any = self._mapper(item)  # type: ignore[arg-type]
            if not isinstance(inner, abc.ObservableBase):
                if not is_future(inner):
                    raise TypeError(
                        f"serialize_by_key: mapper must return an Observable, got {inner!r}"
                    )
                inner = from_future(inner)
        except Exception as exc:
            self.fail(exc)
            return
        if type(inner).subscribe is Observable.subscribe:
            # Observable.subscribe wraps every subscription in an AutoDetachObserver and a pass
            # through the CurrentThreadScheduler trampoline; that is most of the per-item cost
            # (benchmarks/bench_serialize.py). The lane already detaches itself, and _start is
            # our trampoline, so subscribe the core directly and do AutoDetachObserver's work.
            try:
                sub = inner._subscribe_core(lane, self._scheduler)
            except Exception as exc:
                if lane.sub is _FINISHED or not self.fail(exc):
                    raise  # not the inner's failure: e.g. the observer raised (see emit)
                return
            if not isinstance(sub, abc.DisposableBase):
                sub = Disposable(sub if callable(sub) else None)
        else:
            sub = inner.subscribe(lane, scheduler=self._scheduler)
        with self._lock:
            if not self._done and lane.sub is None:  # still running: keep it for disposal
                lane.sub = sub
                return
        # The inner terminated while we subscribed (release it, as AutoDetachObserver would), or
        # the whole subscription was disposed or failed meanwhile.
        sub.dispose()

    # -- downstream --------------------------------------------------------------------------

    def emit(self, value: _R) -> None:
        with self._lock:
            if self._done:
                return
            if self._emitting:
                self._queue.append(value)
                return
            self._emitting = True
        try:
            self._observer.on_next(value)
        except BaseException:
            self._downstream_failed()
            raise
        self._deliver()

    def fail(self, error: Exception) -> bool:
        """Terminate with ``error``; False if the subscription had already ended."""
        with self._lock:
            if self._done:
                return False
            deliver = self._terminate(error)
            lanes = self._close()
        self._dispose_lanes(lanes)
        self._source_sub.dispose()
        if deliver:
            self._deliver()
        return True

    def _terminate(self, terminal: object) -> bool:
        """Record the terminal notification (lock held); True if the caller must deliver it."""
        self._done = True
        self._terminal = terminal
        if self._emitting:
            return False  # the delivering thread sends it after the queued values
        self._emitting = True
        return True

    def _deliver(self) -> None:
        """Drain queued values, then the terminal notification; the caller holds ``_emitting``."""
        observer = self._observer
        try:
            while True:
                with self._lock:
                    batch = self._queue
                    if not batch:
                        terminal = self._terminal
                        if terminal is None:
                            self._emitting = False
                            return
                        self._terminal = None  # delivered once; _emitting stays set forever
                        break
                    self._queue = []
                for value in batch:
                    observer.on_next(value)
        except BaseException:
            self._downstream_failed()
            raise
        if terminal is _COMPLETED:
            observer.on_completed()
        else:
            observer.on_error(terminal)  # type: ignore[arg-type]

    def _dispose(self) -> None:
        """Unsubscribe: drop queued emissions and per-key state, dispose source and inners."""
        with self._lock:
            self._queue = []
            self._terminal = None
            lanes = self._close()
        self._source_sub.dispose()
        self._dispose_lanes(lanes)

    # The observer raised from on_next: it is broken, so tear down as Rx's SafeObserver does.
    _downstream_failed = _dispose

    def _close(self) -> list[_Lane[_T, _R]]:
        """Mark the subscription done and hand back its lanes to dispose (lock held)."""
        self._done = True
        return self._lanes.clear()

    @staticmethod
    def _dispose_lanes(lanes: list[_Lane[_T, _R]]) -> None:
        for lane in lanes:
            lane.item = None
            sub = lane.sub
            if sub is not None:
                sub.dispose()
