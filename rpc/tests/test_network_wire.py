"""Decision 35's result on the gRPC wire: what the egress policy refused crosses both ways
(JobOutcome -> RunJobResponse -> JobOutcome, a session step's too), and every answer a worker
cannot honestly send is a PoolWorkerError before anyone reads it. Pure: no server, no sandbox."""

from __future__ import annotations

import dataclasses

import pytest
from readie_policy.jobs import CodeJob, JobOutcome, StepOutcome
from readie_protocol.errors import PoolWorkerError
from readie_protocol.events import MAX_REFUSED_NAMES, MAX_REFUSED_REPORTED, NetworkReport, RefusedConnection
from readie_rpc._client_wire import job_outcome, step_outcome
from readie_rpc._convert import run_job_response
from readie_rpc._proto.readie.v1 import worker_pb2 as pb

OUTCOME = JobOutcome(0, "", "", False, False, None, 1, "3.11", (), None, "fake")
NETWORKED = CodeJob("base", "x", network=True)
OFFLINE = CodeJob("base", "x")
REPORT = NetworkReport(
    refused_connections=7,
    refused=(RefusedConnection("169.254.169.254", 80, 4), RefusedConnection("203.0.113.9", 8000, 2)),
    refused_lookups=3,
    refused_names=("rebound.test.example", "denied.test.example"),
)


def test_a_network_report_crosses_the_wire_both_ways() -> None:
    outcome = dataclasses.replace(OUTCOME, network=REPORT)
    response = pb.RunJobResponse.FromString(run_job_response(outcome).SerializeToString())  # as bytes cross it
    assert response.HasField("network") and response.network.refused[0].port == 80
    assert job_outcome(response, NETWORKED) == outcome
    # a router passes it on as it read it: the same answer the next hop reads
    assert job_outcome(run_job_response(job_outcome(response, NETWORKED)), NETWORKED) == outcome


def test_a_session_step_carries_its_own_report() -> None:
    outcome = dataclasses.replace(OUTCOME, network=REPORT)
    response = run_job_response(outcome, StepOutcome(outcome, 3, False), "s-1")
    assert step_outcome(response, NETWORKED) == StepOutcome(outcome, 3, False)


def test_no_network_is_no_field_and_no_report() -> None:
    response = run_job_response(OUTCOME)
    assert not response.HasField("network")
    assert job_outcome(response, NETWORKED).network is None  # a worker older than protocol 6, or nothing ran
    quiet = run_job_response(dataclasses.replace(OUTCOME, network=NetworkReport()))
    assert quiet.HasField("network") and job_outcome(quiet, NETWORKED).network == NetworkReport()


def _answer(**report) -> pb.RunJobResponse:
    fields = {"refused_connections": 100, "refused_lookups": 100, **report}
    return pb.RunJobResponse(exit=0, network=pb.NetworkReport(**fields))


def _refused(address: str = "203.0.113.1", port: int = 443, count: int = 1) -> pb.RefusedConnection:
    return pb.RefusedConnection(address=address, port=port, count=count)


@pytest.mark.parametrize(("report", "message"), [
    ({"refused": [_refused(f"203.0.113.{i}") for i in range(MAX_REFUSED_REPORTED + 1)]}, "at most 32"),
    ({"refused_names": [f"n{i}.example" for i in range(MAX_REFUSED_NAMES + 1)]}, "at most 32"),
    ({"refused": [_refused(port=0)]}, "port of 0"),
    ({"refused": [_refused(port=65536)]}, "port of 65536"),
    ({"refused": [_refused(count=0)]}, "count of 0"),
    ({"refused": [_refused("metadata.google.internal")]}, "not an IP address"),
    ({"refused": [_refused("")]}, "not an IP address"),
    ({"refused": [_refused("fe80::1%eth0")]}, "not an IP address"),
    ({"refused": [_refused("203.0.113.1" + " " * 40)]}, "not an IP address"),
    ({"refused": [_refused("1" * 10_000)]}, "not an IP address"),
    ({"refused": [_refused(), _refused()]}, "twice"),
    ({"refused": [_refused(count=1), _refused("203.0.113.2", count=5)]}, "out of order"),
    ({"refused": [_refused(count=101)]}, "more refused connections than its total"),
    ({"refused_names": ["a" * 254]}, "no DNS name"),
    ({"refused_names": ["x" * 1_000_000]}, "no DNS name"),
    ({"refused_names": [""]}, "no DNS name"),
    ({"refused_names": ["bad\nname.example"]}, "no DNS name"),
    ({"refused_names": ["a.example"] * 2}, "twice"),
    ({"refused_names": ["a.example", "b.example"], "refused_lookups": 1}, "names 2 refused lookups but counts 1"),
])
def test_a_report_no_worker_sends_is_a_worker_error(report: dict, message: str) -> None:
    with pytest.raises(PoolWorkerError, match=f"the worker answered a network report that .*{message}"):
        job_outcome(_answer(**report), NETWORKED)


def test_a_report_for_a_job_without_the_network_is_a_worker_error() -> None:
    with pytest.raises(PoolWorkerError, match="to a job without the network"):
        job_outcome(_answer(), OFFLINE)
    with pytest.raises(PoolWorkerError, match="to a job without the network"):
        step_outcome(_answer(), OFFLINE)


def test_the_bounds_themselves_are_read() -> None:
    name = ".".join(["a" * 63] * 3 + ["a" * 61])  # 253 characters, the longest DNS name
    report = _answer(
        refused=[_refused(f"203.0.113.{i}", 65535) for i in range(MAX_REFUSED_REPORTED)],
        refused_names=[name, *(f"n{i}.example" for i in range(MAX_REFUSED_NAMES - 1))],
        refused_connections=2**32 - 1,
    )
    outcome = job_outcome(report, NETWORKED)
    assert outcome.network is not None
    assert (len(outcome.network.refused), len(outcome.network.refused_names)) == (MAX_REFUSED_REPORTED, MAX_REFUSED_NAMES)
    assert outcome.network.refused_names[0] == name


def test_a_count_past_what_the_wire_carries_is_sent_as_the_largest() -> None:
    huge = NetworkReport(2**40, (RefusedConnection("203.0.113.1", 443, 2**40),), 2**33, ())
    read = job_outcome(run_job_response(dataclasses.replace(OUTCOME, network=huge)), NETWORKED).network
    assert read == NetworkReport(2**32 - 1, (RefusedConnection("203.0.113.1", 443, 2**32 - 1),), 2**32 - 1, ())
