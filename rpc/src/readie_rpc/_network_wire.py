"""What the egress policy refused a job (decision 35), on the gRPC wire both ways: the serving
side writes an outcome's :class:`NetworkReport` into ``RunJobResponse.network``, the calling
side (a router, ``readie pool --router``) reads it back only through
:func:`network_from_message`, held to what an honest worker sends (readie_protocol.network's
bounds). Validation without I/O.
"""

from __future__ import annotations

from ._proto.readie.v1 import worker_pb2 as pb
from readie_protocol.errors import PoolWorkerError
from readie_protocol.network import MAX_REFUSED_COUNT, NetworkReport, network_report

__all__ = ["network_from_message", "network_message"]


def network_message(report: NetworkReport) -> pb.NetworkReport:
    """The report as the wire carries it; a count past uint32 (a day of a job hammering denied
    addresses could get there) is sent as the largest, not failed on."""
    return pb.NetworkReport(
        refused_connections=_uint32(report.refused_connections),
        refused=[pb.RefusedConnection(address=item.address, port=item.port, count=_uint32(item.count)) for item in report.refused],
        refused_lookups=_uint32(report.refused_lookups),
        refused_names=report.refused_names,
        allowed_connections=_uint32(report.allowed_connections),
    )


def _uint32(count: int) -> int:
    return min(count, MAX_REFUSED_COUNT)


def network_from_message(message: pb.NetworkReport, *, networked: bool) -> NetworkReport:
    """A worker's report, or PoolWorkerError for one no worker sends: to a job without the
    network (``networked`` false), or past the report's bounds."""
    if not networked:
        raise PoolWorkerError("the worker answered a network report to a job without the network")
    try:
        return network_report(
            message.refused_connections, message.refused, message.refused_lookups, message.refused_names,
            message.allowed_connections, entry=lambda item: (item.address, item.port, item.count),
        )
    except ValueError as exc:  # the check's Invalid
        raise PoolWorkerError(f"the worker answered a network report that {exc}") from None
