"""The proof time budget: run one symbolic attempt for at most `seconds`, in any thread.

    symbolic(fn, seconds) -> (fn(deadline), None) or (None, why it stopped)

In the main thread a repeating SIGALRM interrupts a long sympy step (sympy's own `except Exception`
lets ProofTimeout, a BaseException, pass). Elsewhere signals cannot be used, so the attempt runs in
a forked child process, whose forking thread is its main thread, and is killed past the budget;
without fork the cooperative deadline (checked between steps) is all there is.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import threading
import time
import warnings
from contextlib import contextmanager

import sympy

from . import analysis as A


def _alarm_usable(seconds: float | None) -> bool:
    return (seconds is not None and hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL)[0] == 0)


def _run_body(fn, deadline):
    """The one frame inside which the alarm may raise: fn's work, and nothing of the set-up or
    clean-up around it."""
    return fn(deadline)


def _inside_body(frame) -> bool:
    while frame is not None:
        if frame.f_code is _run_body.__code__:
            return True
        frame = frame.f_back
    return False


@contextmanager
def _alarm(seconds: float | None):
    """SIGALRM after `seconds` raising ProofTimeout, in the main thread when no other timer runs.

    The handler raises only while `_run_body` is on the stack. An alarm that lands in the set-up or
    the clean-up (the clean-up cancels the timer; a ProofTimeout raised there would skip it and leave
    a repeating timer behind, which once killed a test process at exit) is ignored; the next one,
    50 ms on, comes while the body runs or never."""
    if not _alarm_usable(seconds):
        yield False
        return

    def on_alarm(signum, frame):
        if _inside_body(frame):
            raise A.ProofTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    # the alarm repeats: a ProofTimeout raised where Python ignores exceptions (a weakref or GC
    # callback that sympy's work triggered) is lost, and the next one still ends the step
    try:
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-4), 0.05)
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def symbolic(fn, seconds: float | None):
    """Run fn(deadline) within the budget: (result, None) or (None, why it stopped).

    In the main thread a SIGALRM interrupts a long sympy step. Elsewhere (a thread, or a timer already
    running) signals cannot be used, so the work runs in a forked child process, where the forking
    thread is the main thread and the alarm works; the parent waits at most the budget plus a second
    and kills the child past it. Without fork the deadline is checked between steps only."""
    if seconds is not None and seconds > 0 and not _alarm_usable(seconds):
        forked = _in_child(fn, seconds)
        if forked is not None:
            return forked
    return _symbolic_here(fn, seconds)


def _symbolic_here(fn, seconds: float | None):
    if seconds is not None and seconds <= 0:   # nothing to try: no timer, no fork
        return None, _timeout(seconds)
    try:
        deadline = A.Deadline(seconds)
        with _alarm(seconds) as armed:
            deadline.interruptible = armed or seconds is None
            return _run_body(fn, deadline), None
    except A.ProofTimeout:
        return None, _timeout(seconds)
    except (RecursionError, sympy.SympifyError, sympy.PolynomialError, TypeError, ValueError) as exc:
        return None, f"sympy failed ({type(exc).__name__}: {exc})"


def _timeout(seconds) -> str:
    return f"sympy did not decide within the {seconds:g} s budget"


_CHILD_GRACE = 1.0   # seconds the parent waits past the budget (fork, pickling) before killing


def _in_child(fn, seconds: float):
    """_symbolic_here(fn, seconds) in a forked child, its result pickled back; None when fork fails."""
    if not hasattr(os, "fork") or not hasattr(signal, "setitimer"):
        return None
    read_end, write_end = os.pipe()
    try:
        with warnings.catch_warnings():   # the child only runs sympy and exits: no lock it needs is held
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:   # the child: answer through the pipe and leave without running any cleanup
        try:
            os.close(read_end)
            try:
                payload = pickle.dumps(_symbolic_here(fn, seconds))
            except BaseException as exc:   # noqa: BLE001 - whatever happened must reach the parent
                payload = pickle.dumps((None, f"sympy failed ({type(exc).__name__}: {exc})"))
            view = memoryview(payload)
            while view:
                view = view[os.write(write_end, view):]
        finally:
            os._exit(0)
    os.close(write_end)
    chunks, end = [], time.monotonic() + seconds + _CHILD_GRACE
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                return None, _timeout(seconds)
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    try:
        return pickle.loads(b"".join(chunks))
    except Exception:   # noqa: BLE001 - a child that died mid-answer
        return None, "sympy failed (the proof process ended without an answer)"


__all__ = ["symbolic"]
