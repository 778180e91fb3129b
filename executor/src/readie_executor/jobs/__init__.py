"""Code jobs: run a script or inline code the way ``python3 step.py`` would, inside the sandbox.

The worker sends the executor ``{"func": run_job, "args": (job,), "kwargs": {}}``
(``run_job`` pickled by reference) and gets back the result as UTF-8 JSON, not a
pickle: see ``RAW_RESPONSE_ATTRIBUTE`` in :mod:`readie_executor._calls`. The
job dict and the result are described in :mod:`._spec` and :mod:`._result`;
the size bounds both sides agree on are in :mod:`._bounds`. A process runs jobs only after
handing them its fds 0, 1 and 2 (``dedicate_stdio``: they stay the capture's between jobs).

Files in the job's workspace (decision 31): a job's ``files`` ride in its dict and are written
before it runs (:mod:`._workspace`); ``collect`` (:mod:`._collect`), ``upload_chunk``,
``download_chunk`` and ``list_files`` (:mod:`._transfers`) are calls of their own, answered in
:mod:`readie_executor.filewire`'s layout.

Standard library only: this runs in the sandbox's own python3.
"""

from . import _bounds as bounds
from ._collect import collect
from ._drain import dedicate_stdio, fill_stdio
from ._runner import EXIT_NOT_STARTED, WARMED_UP, run_job, warm_up
from ._spec import DEFAULT_INLINE_NAME
from ._transfers import download_chunk, list_files, upload_chunk

__all__ = [
    "DEFAULT_INLINE_NAME",
    "EXIT_NOT_STARTED",
    "WARMED_UP",
    "bounds",
    "collect",
    "dedicate_stdio",
    "fill_stdio",
    "download_chunk",
    "list_files",
    "run_job",
    "upload_chunk",
    "warm_up",
]
