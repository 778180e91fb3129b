"""A server CLI stops on SIGTERM even when the kernel hands the signal to a thread other than main."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# The signal is sent to a helper thread with pthread_kill: the case in which a
# main thread blocked in Event.wait() without a timeout never runs its handler.
PROGRAM = textwrap.dedent(
    """
    import signal, threading, time
    from readie_worker.stop_signal import StopSignal

    stop = StopSignal()
    parked = threading.Event()
    helper = threading.Thread(target=parked.wait, daemon=True)
    helper.start()
    time.sleep(0.2)  # main is in stop.wait() by now
    threading.Timer(0.2, signal.pthread_kill, (helper.ident, signal.SIGTERM)).start()
    stop.wait()
    print("stopped", stop.is_set())
    """
)


def test_a_signal_delivered_to_another_thread_still_stops_the_main_thread():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=10)
    assert (done.returncode, done.stdout) == (0, "stopped True\n"), done.stderr


# A drained process exits while a second SIGTERM arrives: Python restores the default
# action of the signals it handled during finalization, which killed it with 143.
SECOND_SIGNAL = textwrap.dedent(
    """
    import os, signal, sys
    from readie_worker.stop_signal import StopSignal

    stop = StopSignal()
    os.kill(os.getpid(), signal.SIGTERM)
    stop.wait()
    os.kill(os.getpid(), signal.SIGTERM)  # during the drain
    os.kill(os.getpid(), signal.SIGINT)
    print("drained", signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, flush=True)
    sys.exit(0)
    """
)


def test_a_second_stop_signal_changes_nothing_the_drained_process_exits_zero():
    done = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, timeout=10)
    assert (done.returncode, done.stdout) == (0, "drained True\n"), done.stderr
