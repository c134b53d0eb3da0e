"""Exceptions raised by Python signal handlers while pinpool's code runs.

A signal's Python handler runs in the main thread between two steps of whatever that thread
is running, pinpool's code included: torch's SIGCHLD handler, which its DataLoader installs
(``RuntimeError: DataLoader worker (pid N) is killed by signal ...`` as soon as a worker of a
running iterator has failed), the default SIGINT handler (``KeyboardInterrupt``), or any
handler of the caller's. Such an exception goes through pinpool unchanged, wherever it lands:

- pinpool's ``except`` clauses name pinpool's own errors or the errors of the call they
  wrap; one that could also match a handler's exception (a ``RuntimeError``) lets through
  what :func:`signal_of` says a handler raised;
- code that must clean up does so and raises the exception again;
- a finalizer (a ``__del__``, a ``weakref.finalize`` callback) cannot raise to anyone:
  Python prints the exception and goes on, so torch's error would only come from its next
  status check of the workers, seconds later, and an interrupt not at all. A finalizer hands
  the exception back to its signal (:func:`hand_back`): the signal's handler is replaced,
  for one call, by one that puts the original back and raises that same exception, and the
  signal is sent to the main thread again as soon as that thread has left the finalizers it
  runs (pinpool's, and those the object's going sets off).

The exception itself is raised again, not the handler run a second time: torch's SIGCHLD
handler reports a failed worker once (it forgets that iterator's workers as it raises), so a
second run finds nothing and the error would wait for torch's status check. The signal is
sent again, rather than flagged with ``_thread.interrupt_main``: a flag set in the finalizer
would run the handler at the finalizer's next step, inside it again, and a flag does not wake
a main thread that waits in a system call.
"""

from __future__ import annotations

import importlib
import multiprocessing.util
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

#: ``signal``'s C module: its ``valid_signals`` and ``getsignal`` make no enum of each signal,
#: which ``signal``'s own do, in Python frames (where another handler's exception could land)
#: and ten times slower.
_c_signal: Any = importlib.import_module("_signal")
#: The finalizers that handed an exception back: the signal waits until none is running.
_FINALIZERS: set[CodeType] = set()
#: How long a signal handed back waits for the main thread to leave the finalizers it runs.
_WAIT_S = 60.0


def signal_of(exc: BaseException) -> int | None:
    """The signal whose Python handler raised ``exc`` (found among the frames it went
    through), or None if none did."""
    if threading.current_thread() is not threading.main_thread():
        return None  # (handlers run in the main thread only)
    codes: dict[Any, int] = {}
    for signum in _c_signal.valid_signals():
        handler = _c_signal.getsignal(signum)
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            codes.setdefault(code, int(signum))
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        found = codes.get(code)
        if found is None and code is _RAISE_ONCE:
            # Raised again by a handed-back signal (:func:`hand_back`), which came while the
            # main thread had entered another finalizer after all: that one hands it back too.
            got = tb.tb_frame.f_locals.get("got")
            found = int(got) if isinstance(got, int) else None
        if found is not None:
            return found
        tb = tb.tb_next
    # The default SIGINT handler is written in C: it leaves no frame.
    if (
        isinstance(exc, KeyboardInterrupt)
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        return int(signal.SIGINT)
    return None


def hand_back(exc: BaseException) -> bool:
    """For a finalizer that caught ``exc`` from its cleanup: if a signal handler raised it,
    ``exc`` is raised again in the main thread once that thread has left the finalizers it
    runs (by the signal, sent again, whose handler raises it once and is then the original
    again), and True is returned (the finalizer drops ``exc``); else False (the finalizer
    raises it, for Python to report)."""
    signum = signal_of(exc)
    if signum is None:
        return False
    original = _c_signal.getsignal(signum)

    def raise_once(got: int, frame: FrameType | None) -> None:
        # The main thread may have entered a finalizer again after the signal was sent: the
        # exception would be lost there too, so the signal waits and is sent once more.
        if _in_finalizer(frame) and _send_later(got):
            return
        if _c_signal.getsignal(got) is raise_once:
            _c_signal.signal(got, original)
        raise exc

    _FINALIZERS.add(sys._getframe(1).f_code)
    _c_signal.signal(signum, raise_once)  # (the main thread's: signal_of says it is this one)
    if not _send_later(signum):  # (the interpreter is exiting: no thread can start)
        _c_signal.signal(signum, original)
        return False
    # Kept without the frames it went through: they hold what the finalizer was letting go
    # (the object, and what only it holds), which must go now, not when the exception does.
    exc.__traceback__ = None
    exc.__context__ = None
    exc.add_note(
        f"(raised by the handler of signal {signum} in a finalizer of pinpool's, which "
        "handed it back to be raised here)"
    )
    return True


#: The code of the handler :func:`hand_back` installs for one call (it raises the exception
#: handed back): an exception whose frames pass through it was a handler's as well.
_RAISE_ONCE: CodeType = next(
    c for c in hand_back.__code__.co_consts if isinstance(c, CodeType) and c.co_name == "raise_once"
)


def _send_later(signum: int) -> bool:
    """Starts the thread that sends ``signum`` to the main thread once that thread is out of
    the finalizers it runs; False if no thread can start (the interpreter is exiting)."""
    sender = threading.Thread(
        target=_send_when_out, args=(signum,), name="pinpool-signal", daemon=True
    )
    try:
        sender.start()
    except RuntimeError:
        return False
    return True


def _send_when_out(signum: int) -> None:
    main = threading.main_thread()
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        frame: FrameType | None = sys._current_frames().get(main.ident)  # type: ignore[arg-type]
        if not _in_finalizer(frame):
            break
        del frame
        time.sleep(0.001)
    if main.ident is not None and main.is_alive():
        signal.pthread_kill(main.ident, signum)


def _in_finalizer(frame: FrameType | None) -> bool:
    """Whether the main thread, at ``frame``, is running a finalizer: pinpool's that handed a
    signal back, or any other, where the handler's exception would be lost as well. A
    finalizer's return can set off others: when a ``__del__`` returns, the object goes, and
    what only it held goes with it (multiprocessing's queues and processes run their
    ``Finalize`` callbacks then). Between two of them the main thread is in C and holds the
    GIL, so a thread that looks with the GIL held sees it inside one or past them all; and
    the handler, which runs between two of the main thread's steps, sees where it came."""
    while frame is not None:
        code = frame.f_code
        if code in _FINALIZERS or code in _OTHER_FINALIZERS or code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _callbacks_of(*inits: Any) -> set[CodeType]:
    """The code of the functions ``inits`` define inside them (the weak references' callbacks
    of ``weakref``'s containers, made in their ``__init__``)."""
    return {c for init in inits for c in init.__code__.co_consts if isinstance(c, CodeType)}


#: The code of the calls that run other libraries' finalizers: multiprocessing's ``Finalize``
#: (itself a weak reference's callback), ``weakref.finalize``, and the callbacks by which
#: ``weakref``'s containers forget an entry that went (they run as the object goes, one
#: after another: multiprocessing's registries and torch's are such containers).
_OTHER_FINALIZERS: frozenset[CodeType] = frozenset(
    {multiprocessing.util.Finalize.__call__.__code__, weakref.finalize.__call__.__code__}
    | _callbacks_of(
        weakref.WeakValueDictionary.__init__,
        weakref.WeakKeyDictionary.__init__,
        weakref.WeakSet.__init__,
    )
)


def finalizing(cleanup: Callable[..., Any], *args: Any) -> None:
    """``cleanup(*args)``, run as a finalizer (``weakref.finalize(obj, finalizing, ...)``):
    an exception a signal handler raised in it is handed back (:func:`hand_back`)."""
    try:
        cleanup(*args)
    except BaseException as exc:
        if not hand_back(exc):
            raise
