"""readie router: gRPC front end and the pool JSONL protocol.

Public: :mod:`readie_router.protocol` (the pool protocol's sans-IO pieces),
the CLIs (``pool_cli``, ``router_cli``), ``testing``, and :func:`read_script`,
how ``readie pool`` reads a request's script without following a symlink.
Everything else is private.
"""

from ._job_building import read_script

__all__ = ["read_script"]
