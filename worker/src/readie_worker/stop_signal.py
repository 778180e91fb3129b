"""The main thread's wait for SIGTERM or SIGINT, which a server's CLI drains on.

A Python signal handler runs in the main thread, but the kernel hands a
process-directed signal to any thread that does not block it, grpc's and the
stderr drains' included. When it lands elsewhere the main thread is not
interrupted: blocked in ``Event.wait()`` with no timeout it never returns to
the interpreter to run the handler, and the process ignores SIGTERM. So the
wait polls; a signal is acted on within :data:`SIGNAL_POLL_S`.
"""

from __future__ import annotations

import signal
import threading

#: How long a signal delivered to another thread can wait for the main thread.
SIGNAL_POLL_S = 0.1

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Set by the first SIGTERM or SIGINT; a later one changes nothing.

    Construct it in the main thread (where Python installs signal handlers).
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        # Nothing but the flag: the handler may run while the main thread is inside a log call.
        self._event.set()
        # And ignored from now on: at exit Python puts back the default action of a signal it
        # handled, and a second SIGTERM during that would kill a process that drained cleanly
        # (exit 143, not 0). SIG_IGN is left in place.
        for stop in STOP_SIGNALS:
            signal.signal(stop, signal.SIG_IGN)

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        """Return once a stop signal arrived."""
        while not self._event.wait(SIGNAL_POLL_S):
            pass
