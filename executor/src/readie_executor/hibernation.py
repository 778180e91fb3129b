"""Hibernation: a serving executor goes back to its capture point, to be checkpointed again.

A session's sandbox is checkpointed by the worker (``runsc checkpoint``),
and restored later, or twice (a fork). runsc refuses to save a Unix socket
bound to a host path, and kills the container trying (notes), so the
executor must hold none when the checkpoint is taken. The sequence:

1. the worker sends :data:`HIBERNATE` as a message on its connection, between
   calls (a control message, not a pickle, like a host-function reply);
2. the executor closes its listening socket, answers :data:`HIBERNATING`,
   closes the connection, and blocks reading the hand-over pipe: the stdin it
   was restored with, kept on a descriptor of its own (``__main__``);
3. the worker reads the answer and then the end of the connection, which
   tells it both sockets are closed, and runs ``runsc checkpoint``;
4. at a restore (or a ``--leave-running`` checkpoint's resume) the blocked
   read continues on the new sandbox's stdin, where the worker writes the
   same hand-over line as after any restore; the executor binds its socket
   again and serves. ``__main__``, imported modules, threads, limits and the
   seccomp filter are all as they were.

Only the worker can send :data:`HIBERNATE`: a job that writes on the socket
by hand writes to the worker, not to the executor's reader.
"""

from __future__ import annotations

#: The worker's request to hibernate. Never a valid pickle (a pickle starts with b"\x80").
HIBERNATE = b"readie-hibernate"
#: The executor's answer; the connection ends right after it.
HIBERNATING = b"readie-hibernating"
