"""What ``execute`` returns, and what it decides at the call: the job's shape and its arguments.

``execute(fn, *args, key=..., timeout=..., overflow=...)`` checks its arguments at the call and
returns an :class:`Execution`: a cold Observable (each subscription is one submission) that is
also awaitable (``await`` is one submission done by the awaiting task itself, the coordinator's
awaited path) and a coroutine, so ``asyncio.create_task`` and ``gather`` take it as it is.
The coordinator and each tenant of a ``TenantScheduler`` are its owners.

Where a job runs is decided here, once per call, from what ``fn`` is:

* an ``async def`` function, a ``functools.partial`` of one, a bound ``async def`` method, or a
  callable whose code is known to return an awaitable (below): an *async* job. It is called on
  the asyncio loop and its awaitable awaited there, inside the awaiting task when awaited;
* anything else: a *sync* job, called on the coordinator's scheduler (its worker threads by
  default), because it may block and must never run on an event loop's thread.

A sync callable may return an awaitable all the same: ``lambda: handle(message)`` is an async
job in disguise, and it is how most code writes a job with arguments. Its first call runs on a
worker thread like any sync job, and the awaitable it returns is awaited on the loop. The
callable's *code object* is then remembered (every lambda of one expression in the source shares
it), so every later job of that code is called on the loop at once, with no thread hop; a
wrapper such as ``lambda: fn(*args)`` is remembered per function it wraps (``_key``). The
coordinator asks again when a job's turn comes (``remembered``), so jobs submitted before the
first one returned (a ``gather`` of thousands) take the loop too. Should a remembered code ever
return something else (a lambda that dispatches to sync and async functions), it is forgotten
again: that one call ran on the loop, and later ones take the worker again.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine, Generator, Hashable
from inspect import CO_COROUTINE, CO_VARARGS
from types import CodeType, FunctionType, MethodType
from typing import Any, Final, Protocol, TypeVar, cast

from reactivex import Observable, abc

from .._core.checks import check_deadline, check_hashable, check_overflow
from .._core.retry import Retry

__all__ = [
    "Execution",
    "Owner",
    "check_call",
    "execution",
    "forget",
    "remember",
    "remembered",
]

_T = TypeVar("_T")

# The codes whose callables returned an awaitable (see the module docstring), by identity: a
# key of ids (hashing a code object hashes its bytecode and constants, every time; an id is
# free) -> the code objects themselves, kept alive so their ids cannot be reused meanwhile.
# Bounded, so code generated at run time (``exec`` per call) cannot grow it without end: at
# the bound it starts over, and a forgotten code costs one more thread hop.
_ASYNC_CODES: dict[object, tuple[CodeType, ...]] = {}
_REMEMBER_AT_MOST: Final = 4096


class Owner(Protocol):
    """Who runs an execution's submissions: a coordinator, or a scheduler's tenant."""

    def _subscribe(
        self,
        execution: Execution[Any],
        observer: abc.ObserverBase[Any],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase: ...

    def _await(self, execution: Execution[Any]) -> Coroutine[Any, Any, Any]: ...


class Execution(Observable[_T], Coroutine[Any, Any, _T]):
    """The cold Observable ``execute`` returns: each subscription (or ``await``) submits once.

    Attributes (read by the owner): ``job`` and ``args`` (called as ``job(*args)``), ``key``,
    ``deadline`` (the job's timeout in seconds, or None), ``wait`` (``overflow="wait"`` for
    this call; None: the owner's default), ``retry_policy`` (this call's; None: the owner's)
    and ``is_async`` (where the job runs, see the module docstring).
    """

    __slots__ = (
        "_coroutine",
        "_owner",
        "args",
        "deadline",
        "is_async",
        "job",
        "key",
        "retry_policy",
        "wait",
    )

    def __init__(
        self,
        owner: Owner,
        job: Callable[..., Any],
        args: tuple[Any, ...],
        key: Hashable | None,
        timeout: float | None,
        wait: bool | None,
        is_async: bool,
        retry: Retry | None = None,
    ) -> None:
        # Not Observable.__init__: its RLock serves subclasses that use it (Subjects); this one
        # never does, and a lock per execute() call is measurable (bench_asyncio's rows).
        self._subscribe = None
        self._owner = owner
        self._coroutine: Coroutine[Any, Any, _T] | None = None
        self.job = job
        self.args = args
        self.key = key
        self.deadline = timeout  # (``timeout`` is an Observable operator's name)
        self.wait = wait
        self.is_async = is_async
        self.retry_policy = retry  # this call's; None: the owner's (``retry`` is an operator)

    def _subscribe_core(
        self, observer: abc.ObserverBase[_T], scheduler: abc.SchedulerBase | None = None
    ) -> abc.DisposableBase:
        return self._owner._subscribe(self, observer, scheduler)

    def subscribe(
        self,
        on_next: abc.ObserverBase[_T] | Callable[[_T], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        on_completed: Callable[[], None] | None = None,
        *,
        scheduler: abc.SchedulerBase | None = None,
    ) -> abc.DisposableBase:
        """Submit the job once (the contract of ``Observable.subscribe``).

        ``Observable.subscribe`` wraps every subscription in an AutoDetachObserver and a pass
        through the CurrentThreadScheduler trampoline, so that synchronous emissions cannot
        outrun the returned disposable; that is most of a trivial job's cost (bench_coordinator's
        sync row). A submission never emits during subscribe (a refusal needs no disposable),
        and it delivers one outcome, then holds nothing: it subscribes directly.
        """
        if hasattr(on_next, "on_next"):
            observer = cast(abc.ObserverBase[_T], on_next)
        else:
            observer = _Callbacks(on_next, on_error, on_completed)
        return self._owner._subscribe(self, observer, scheduler)

    def __await__(self) -> Generator[Any, None, _T]:
        """``await coordinator.execute(job)``: the job's result, or its exception.

        The awaiting task does the submission itself (the coordinator's awaited path): an
        async job whose turn comes runs inside it, with no task of its own. Cancelling the
        awaiting task cancels the job (or withdraws it, if it has not started).
        """
        return self._owner._await(self).__await__()

    # The coroutine protocol: ``gather``, ``create_task`` and ``asyncio.run`` take a coroutine
    # as it is, and wrap any other awaitable in a coroutine of their own first, one more frame
    # per job (bench_asyncio's keyed and unkeyed rows: ``gather(*(c.execute(...) ...))``). As a
    # coroutine, an execution is its one awaited submission, started by the first ``send``.
    def send(self, value: Any) -> Any:
        """Advance the awaited submission (the coroutine protocol; ``await`` does it for you)."""
        coroutine = self._coroutine
        if coroutine is None:
            coroutine = self._coroutine = self._owner._await(self)
        return coroutine.send(value)

    def throw(self, *error: Any) -> Any:
        """Raise ``error`` inside the awaited submission (the coroutine protocol)."""
        coroutine = self._coroutine
        if coroutine is None:
            coroutine = self._coroutine = self._owner._await(self)
        return coroutine.throw(*error)

    def close(self) -> None:
        """Close the awaited submission (a coroutine's close): a job waiting its turn leaves."""
        if self._coroutine is not None:
            self._coroutine.close()


class _Callbacks(abc.ObserverBase[Any]):
    """The observer behind ``subscribe(on_next, on_error, on_completed)`` callbacks."""

    __slots__ = ("_on_completed", "_on_error", "_on_next")

    def __init__(
        self,
        on_next: Callable[[Any], None] | None,
        on_error: Callable[[Exception], None] | None,
        on_completed: Callable[[], None] | None,
    ) -> None:
        self._on_next = on_next or _ignore
        self._on_error = on_error or _unhandled
        self._on_completed = on_completed or _nothing

    def on_next(self, value: Any) -> None:
        self._on_next(value)

    def on_error(self, error: Exception) -> None:
        self._on_error(error)

    def on_completed(self) -> None:
        self._on_completed()


def _ignore(_: Any) -> None:
    pass


def _nothing() -> None:
    pass


def _unhandled(error: Exception) -> None:
    # Like reactivex's default_error: an error nobody handles is raised (and logged by the
    # coordinator's delivery, so it is never silently lost).
    raise error


def execution(
    owner: Owner,
    job: Callable[..., Any],
    args: tuple[Any, ...],
    key: Hashable | None,
    timeout: float | None,
    default_timeout: float | None,
    overflow: str | None,
    retry: Retry | None = None,
) -> Execution[Any]:
    """Check ``execute``'s arguments at the call and build its cold Observable.

    Raises:
        TypeError: ``job`` is not callable or cannot be called with ``args``, ``key`` is
            unhashable, ``timeout`` is not a number, ``retry`` is not a ``Retry``.
        ValueError: ``timeout`` is not positive, ``overflow`` is neither "reject" nor "wait".
    """
    wait = None if overflow is None else check_overflow(overflow)
    is_async = check_call(job, args)
    if key is not None:
        try:
            hash(key)  # an unhashable key fails here, at the call
        except TypeError:
            check_hashable(key, "key")  # raises, with the one policy's message
    timeout = default_timeout if timeout is None else check_deadline(timeout)
    if retry is not None and not isinstance(retry, Retry):
        raise TypeError(f"retry must be a rxcoord.Retry or None, not {retry!r}")
    return Execution(owner, job, args, key, timeout, wait, is_async, retry)


def check_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    """Check that ``fn(*args)`` is a valid call; whether ``fn`` is an async job (see above).

    A plain function, a partial of one or a bound method is read from its code object (a few
    attribute reads, no ``inspect``); other callables through ``inspect.signature``. A callable
    whose signature cannot be read is accepted.

    Raises:
        TypeError: ``fn`` is not callable, or cannot be called with ``args`` (which would only
            fail later, on another thread, as the job's error).
    """
    target: Any = fn
    given = len(args)
    while type(target) is functools.partial:
        if target.keywords:
            break  # keywords may fill any parameter: the signature path decides
        given += len(target.args)
        target = target.func
    if type(target) is MethodType:
        target = target.__func__
        given += 1
    if type(target) is FunctionType:
        # Whether ``given`` positional arguments fit the code (else ask inspect, which says
        # why not). Inline, not a helper: every execute() comes here (bench_asyncio's rows).
        code = target.__code__
        if (
            not code.co_kwonlyargcount or len(target.__kwdefaults__ or ()) == code.co_kwonlyargcount
        ) and (
            code.co_argcount - len(target.__defaults__ or ()) <= given <= code.co_argcount
            or (given > code.co_argcount and code.co_flags & CO_VARARGS)
        ):
            return bool(code.co_flags & CO_COROUTINE) or (
                _key(target, code)[0] in _ASYNC_CODES if _ASYNC_CODES else False
            )
    elif not callable(fn):
        raise TypeError(f"job must be callable, not {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): let it run
        return inspect.iscoroutinefunction(fn)
    try:
        signature.bind(*args)
    except TypeError as exc:
        described = "no arguments" if not args else f"the arguments {args!r}"
        raise TypeError(
            f"job {fn!r} cannot be called with {described}: its signature is {signature} "
            f"({exc}); pass execute(fn, *args) with the arguments it needs, or a lambda"
        ) from None
    return inspect.iscoroutinefunction(fn)


def _key(function: FunctionType, code: CodeType) -> tuple[object, tuple[CodeType, ...]]:
    """The cache key of a function (and the codes it names): its code, and the codes of the
    functions its closure holds.

    A wrapper such as ``lambda: fn(*args)`` (one code for whatever ``fn`` it wraps) is then
    remembered per wrapped function: a wrapper that once forwarded to an ``async def`` does not
    bring a blocking function it forwards to onto the loop. The closure of the README's
    ``lambda: handle(m)`` holds the message, not a function: its code alone is the key.
    """
    closure = function.__closure__
    if not closure:
        return id(code), (code,)
    codes = [code]
    for cell in closure:
        try:
            held: Any = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        while type(held) is functools.partial:
            held = held.func
        if type(held) is MethodType:
            held = held.__func__
        if type(held) is FunctionType:
            codes.append(held.__code__)
    if len(codes) == 1:
        return id(code), (code,)
    return tuple(id(c) for c in codes), tuple(codes)


def _function(fn: Callable[..., Any]) -> FunctionType | None:
    """The plain function behind ``fn`` (through partials and bound methods), if any."""
    target: Any = fn
    while type(target) is functools.partial:
        target = target.func
    if type(target) is MethodType:
        target = target.__func__
    return target if type(target) is FunctionType else None


def remember(fn: Callable[..., Any]) -> None:
    """``fn`` returned an awaitable: later jobs of its code are called on the loop at once."""
    function = _function(fn)
    if function is not None:
        key, codes = _key(function, function.__code__)
        if key not in _ASYNC_CODES:
            if len(_ASYNC_CODES) >= _REMEMBER_AT_MOST:
                _ASYNC_CODES.clear()
            _ASYNC_CODES[key] = codes


def remembered(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``'s code has returned an awaitable before (see the module docstring)."""
    if not _ASYNC_CODES:
        return False
    function = _function(fn)
    return function is not None and _key(function, function.__code__)[0] in _ASYNC_CODES


def forget(fn: Callable[..., Any]) -> None:
    """``fn``'s code returned something other than an awaitable: worker threads again."""
    function = _function(fn)
    if function is not None:
        _ASYNC_CODES.pop(_key(function, function.__code__)[0], None)
