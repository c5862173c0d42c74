"""Stop requests by signal (Ctrl-C, SIGTERM, SIGHUP: a closed terminal), taken safely at any
moment and any number of times.

A Python signal handler runs in the main thread between two bytecodes, possibly inside
another handler. A handler that takes a lock can find it held by the code it interrupted:
with `threading.Event.set` in `kvmesh serve`'s handler, a second signal arriving during the
first one's `set` (the same lock, not reentrant) hung the process for good, its Ray and app
left running (3 of 20 bursts of signals here). So the handler takes no lock: it records the
request, writes a byte to a pipe that `wait` reads (the self-pipe trick), and raises
`Interrupted`, at most once, after `interrupt`. Only the first stop signal counts: the
handler ignores the rest (nested in itself by a flood of them, it ran out of stack).

The kernel may hand a signal to any thread that does not block it (Ray's C++ threads are
many): then the Python handler waits for the main thread's next bytecode, which a main thread
asleep in `wait`'s read never reaches. `kvmesh serve`, sent its stop signals just as it began
to wait, hung for good that way (2 of 7 stops on a busy machine). So `wait` also makes the
pipe the interpreter's wakeup fd: the C-level handler writes to it from whichever thread
takes the signal, and the read returns.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """Raised by a stop signal into whatever the main thread runs while ``interrupting``."""


class StopSignals:
    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self.requested = False
        # Raise Interrupted at the next signal (a wait that must be cut short, say Serve's
        # for replicas that never start). Cleared by that signal: what the interruption
        # starts (a teardown) must not be cut in turn.
        self.interrupting = False

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, *_: object) -> None:
        # The interruption is claimed first. A second signal's handler can run nested in
        # this one (between two of its bytecodes) inside a call that swallows what it raises:
        # Python's report of a signal "ignored due to race condition", which the ignores
        # below make. Had it claimed the interruption there, Interrupted was lost and the
        # run waited for good (1 of 20 burst runs in a fresh-clone CI).
        interrupt, self.interrupting = self.interrupting, False
        # The first stop signal is the only one that counts (after it ``interrupt`` raises at
        # once, and the drain runs to its end), so the rest are ignored from here: a flood of
        # them nested this handler in itself, each between two bytecodes of the last, until
        # RecursionError escaped into the stop (an exit by SIGTERM in a CI run).
        _ignore_stop_signals()
        self.requested = True
        with contextlib.suppress(BlockingIOError):  # a full pipe already says it
            os.write(self._write, b"\0")
        if interrupt:
            raise Interrupted

    def interrupt(self) -> None:
        """From now on, until the next stop signal, raise ``Interrupted`` at it; at once if one
        already came."""
        self.interrupting = True
        if self.requested and self.interrupting:
            self.interrupting = False
            raise Interrupted

    def close(self) -> None:
        """Ignore stop signals from now on: for the end, once the teardown is over. During
        the interpreter's exit Python puts the default handlers back (but not an ignore), and
        a late signal that another thread takes (Ray's) ended a clean stop with 143."""
        _ignore_stop_signals()

    def wait(self) -> None:
        """Return once a stop signal came: at once if one already did."""
        # Set here, not at install: only the main thread sets it, and while it waits here
        # nothing else can take it over (asyncio's loop does, and gives it up as -1).
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        while not self.requested:
            os.read(self._read, 1)


def _ignore_stop_signals() -> None:
    """Stop signals are ignored from now on. A signal that came just before (its handler due,
    not yet run) finds the ignore, and Python reports it, a traceback on stderr: "OSError:
    Signal 1 ignored due to race condition" (once in a CI run, after a clean stop). Ignoring
    it is what this asks: the report is dropped."""
    # The hook first: a signal due while the ignores go in is reported at once (a traceback
    # after a clean stop in a CI run, when the hook came second).
    if getattr(sys.unraisablehook, "func", None) is not _drop_ignored_signals:  # once
        sys.unraisablehook = functools.partial(_drop_ignored_signals, sys.unraisablehook)
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _drop_ignored_signals(report: Any, unraisable: Any) -> None:
    """``sys.unraisablehook`` once stop signals are ignored: Python's report of a stop signal
    that came due once its handler was an ignore is dropped; anything else goes on to
    ``report``."""
    exc = unraisable.exc_value
    if isinstance(exc, OSError) and str(exc).endswith("ignored due to race condition"):
        return
    report(unraisable)
