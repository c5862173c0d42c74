"""`kvmesh serve`'s stop signals (cluster/stop_signals.py) in processes of their own, each
sent bursts of SIGTERM, SIGINT and SIGHUP: a signal that lands inside the handler of the one
before must neither hang the process (it did, 3 of 20 bursts, with `Event.set` in the
handler) nor cut short the teardown an interruption started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from kvmesh.cluster.stop_signals import SIGNALS, Interrupted, StopSignals

# What the process does after its last line is not under test: the rest of the burst is
# blocked, or a signal landing in the interpreter's exit (default handlers by then) kills it.
# (Blocked, not ignored: setting a handler while signals arrive can fail with "ignored due
# to race condition".)
DONE = """
import signal
signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
"""

WAITS = """
from kvmesh.cluster.stop_signals import SIGNALS, StopSignals
signals = StopSignals()
signals.install()
print("ready", flush=True)
signals.wait()
print("stopped", flush=True)
"""

# A signal the kernel hands to another thread than the one waiting (it does when the main
# thread has one pending or blocks them; Ray's C++ threads are many) runs the handler only at
# the main thread's next bytecode, and a wait already asleep in the kernel never got there:
# `kvmesh serve`, sent its stop signals just as it began to wait, hung for good (2 of 7 stops
# after a proxy restart on a busy machine, and once in CI). Here the main thread blocks them,
# so every signal lands on the other thread. It ends as `kvmesh serve` does, with `close`:
# DONE blocks the rest of the burst in the main thread only, and a signal the other thread
# took during the interpreter's exit (default handlers by then) killed one run in a CI (-15
# after "stopped").
WAITS_WHILE_ANOTHER_THREAD_TAKES_THE_SIGNALS = """
import signal, threading
from kvmesh.cluster.stop_signals import SIGNALS, StopSignals
signals = StopSignals()
signals.install()
threading.Thread(target=threading.Event().wait, daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
print("ready", flush=True)
signals.wait()
signals.close()
print("stopped", flush=True)
"""

# A deployment that never comes up, waited for as serve.run waits: it polls, a sleep of
# CLIENT_POLLING_INTERVAL_S (1 s) at a time. Not one long sleep: a signal that lands after
# the interpreter's last check for signals and before the sleep's system call only trips
# the handler, which then runs when that sleep ends (a CI run hung 10 s in a 60 s sleep, 1
# run in 20, and SIGUSR1's EINTR ran the handler at last). Polling bounds that to one poll.
INTERRUPTED = """
import time
from kvmesh.cluster.stop_signals import SIGNALS, Interrupted, StopSignals
signals = StopSignals()
signals.install()
try:
    signals.interrupt()
    print("ready", flush=True)
    while True:
        time.sleep(1.0)
except Interrupted:
    print("interrupted", flush=True)
time.sleep(0.5)  # the teardown, while the burst goes on
print("torn down", flush=True)
"""


# A run that does not end dumps its Python stack on SIGUSR1, from C, even while it hangs:
# then the failure says where (a CI run once had one such run in 20: the race that
# test_a_wait_stops_when_another_thread_takes_the_signal makes certain).
DUMP = """
import faulthandler, signal
faulthandler.register(signal.SIGUSR1)
"""


def _burst(code: str, bursts: int = 100, times: int = 20) -> list[tuple[int | None, str]]:
    """Run ``code`` ``times`` times, each sent ``bursts`` rounds of the stop signals once it is
    ready: each run's exit status (None: still running after 10 s, killed after dumping its
    stack into its output) and output."""
    runs = []
    for _ in range(times):
        proc = subprocess.Popen(
            [sys.executable, "-c", DUMP + code + DONE], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        for _ in range(bursts):
            for sig in SIGNALS:
                if proc.poll() is None:
                    os.kill(proc.pid, sig)
        try:
            out, _ = proc.communicate(timeout=10)
            runs.append((proc.returncode, out))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            try:
                out, _ = proc.communicate(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            runs.append((None, out))
    return runs


def test_a_burst_of_stop_signals_stops_a_wait_every_time() -> None:
    assert _burst(WAITS) == [(0, "stopped\n")] * 20


def test_a_wait_stops_when_another_thread_takes_the_signal() -> None:
    runs = _burst(WAITS_WHILE_ANOTHER_THREAD_TAKES_THE_SIGNALS, bursts=1, times=3)
    assert runs == [(0, "stopped\n")] * 3


def test_a_burst_of_stop_signals_interrupts_once_and_never_the_teardown() -> None:
    assert _burst(INTERRUPTED) == [(0, "interrupted\ntorn down\n")] * 20


# `kvmesh serve`'s end: its teardown over, stop signals keep coming (an impatient Ctrl-C,
# a supervisor's repeated SIGTERM) while the interpreter exits, with another thread (Ray's)
# that takes them. Python puts the default handlers back during its exit; a signal then
# ended the process with 143 after a clean stop.
CLOSES = """
import threading
from kvmesh.cluster.stop_signals import SIGNALS, StopSignals
signals = StopSignals()
signals.install()
threading.Thread(target=threading.Event().wait, daemon=True).start()
print("ready", flush=True)
signals.wait()
signals.close()
print("stopped", flush=True)
"""


def test_stop_signals_during_the_exit_after_a_stop_change_nothing() -> None:
    """Signals sent without pause from the stop until the process is gone."""
    for _ in range(5):
        proc = subprocess.Popen(
            [sys.executable, "-c", CLOSES], stdout=subprocess.PIPE, text=True
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        while proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        assert (proc.returncode, proc.stdout.read()) == (0, "stopped\n")


# The first stop signal: taken, and every later one ignored. A flood of them nested the
# handler in itself, each run between two bytecodes of the last, until RecursionError escaped
# into the stop: a SIGTERM exit after a clean stop, once in a CI run of the test above (which
# does not make it happen at will). Ignored, a later signal runs no handler at all.
FIRST = """
import os, signal
from kvmesh.cluster.stop_signals import SIGNALS, Interrupted, StopSignals
signals = StopSignals()
signals.install()
os.kill(os.getpid(), signal.SIGTERM)
signals.wait()
print(all(signal.getsignal(sig) is signal.SIG_IGN for sig in SIGNALS))
try:
    signals.interrupt()
except Interrupted:
    print("interrupted at once")
"""


def test_the_first_stop_signal_ignores_the_rest() -> None:
    out = subprocess.run([sys.executable, "-c", FIRST], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, "True\ninterrupted at once\n", "")


# Python's report of a stop signal whose handler came due once ``close`` had made it an
# ignore (the signal landed during ``close``): a traceback on stderr after a clean stop
# (once in a CI run). Made here the way Python makes it, as an unraisable OSError; any other
# unraisable error is still reported.
LATE = """
from kvmesh.cluster.stop_signals import StopSignals
signals = StopSignals()
signals.install()
signals.close()

class Report:
    def __init__(self, exc):
        self.exc = exc
    def __del__(self):
        raise self.exc

Report(OSError("Signal 1 ignored due to race condition"))
Report(ValueError("another"))
print("done", flush=True)
"""


def test_close_drops_the_report_of_a_signal_too_late_to_ignore() -> None:
    proc = subprocess.run([sys.executable, "-c", LATE], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "done\n"
    assert "race condition" not in proc.stderr
    assert "ValueError: another" in proc.stderr


def test_signals_are_the_terminal_and_service_manager_ones() -> None:
    assert set(SIGNALS) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def test_a_signal_before_the_interruptible_wait_interrupts_at_once() -> None:
    signals = StopSignals()
    signals.requested = True  # what the handler recorded while nothing was interruptible
    with pytest.raises(Interrupted):
        signals.interrupt()
    assert not signals.interrupting  # the teardown it starts is not cut in turn


def test_a_signal_nested_in_the_first_ones_handler_cannot_swallow_the_interruption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second signal's handler runs nested in the first one's while it sets the ignores,
    inside a call that swallows what it raises (Python's unraisable hook, reporting a signal
    "ignored due to race condition"). The first handler must still raise Interrupted: before,
    the nested one took the interruption, its raise was swallowed, and the run waited for
    good (a fresh-clone CI run of the burst test above)."""
    from kvmesh.cluster import stop_signals

    signals = StopSignals()
    nested: list[bool] = []

    def ignore_with_a_signal_nested() -> None:  # in place of setting SIG_IGN in pytest
        if not nested:
            nested.append(True)
            with contextlib.suppress(Interrupted):  # as the unraisable hook swallows it
                signals._on_signal()

    monkeypatch.setattr(stop_signals, "_ignore_stop_signals", ignore_with_a_signal_nested)
    signals.interrupting = True
    try:
        with pytest.raises(Interrupted):
            signals._on_signal()
        assert nested and signals.requested and not signals.interrupting
    finally:
        os.close(signals._read), os.close(signals._write)
