"""readie pool: the pool protocol (docs/pool.md) on stdin and stdout, jobs in gVisor sandboxes.

Public: the engine and what it is built from, for ``readie pool`` (:mod:`readie_pool.cli`)
and for the router's Pool service, which runs the same engine behind gRPC:
:class:`PoolEngine`, its one configuration value :class:`PoolSetup`, the
backends it runs jobs on (:class:`JobBackend`, :class:`ThreadedBackend`,
:class:`LocalWorkerBackend`, :func:`choose_checkpoint`), and
:func:`read_script`, how a request's script is read without following a
symlink. Also public: :mod:`readie_pool.sans_io` (the protocol's sans-IO
pieces and the engine's account of a job), :mod:`readie_pool.reference`
(the generated protocol and config references) and :mod:`readie_pool.testing`.
Modules whose names start with ``_`` are private to this package (a test checks it).
"""

from ._backend import JobBackend, LocalWorkerBackend, ThreadedBackend, choose_checkpoint
from ._engine import PoolEngine
from ._job_building import read_script
from ._setup import PoolSetup

__all__ = [
    "JobBackend",
    "LocalWorkerBackend",
    "PoolEngine",
    "PoolSetup",
    "ThreadedBackend",
    "choose_checkpoint",
    "read_script",
]
