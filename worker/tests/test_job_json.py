"""A job's wire forms: the session store's JSON carries its egress policy exactly (decision 35), and
the runner call is the cloudpickle the executor protocol names."""

from __future__ import annotations

import pytest
from readie_policy.egress import Egress, parse_destinations, resolve_egress
from readie_worker._job_json import job_from_json, job_to_json
from readie_worker.jobs import CodeJob


def test_a_jobs_egress_keeps_its_json_form() -> None:
    listed = resolve_egress(parse_destinations(["API.example.com:443", "10.1.0.0/16"]), None)
    for egress in (None, Egress(public=True), listed):
        job = CodeJob("base", "pass", network=egress is not None, egress=egress)
        assert job_from_json(job_to_json(job)) == job
    with pytest.raises(ValueError, match="not a destination"):
        job_from_json({**job_to_json(CodeJob("base", "pass")), "egress": ["a b"]})
    with pytest.raises(ValueError, match="'egress' is not a list"):
        job_from_json({**job_to_json(CodeJob("base", "pass")), "egress": "api.example.com"})


def test_the_runner_call_is_what_cloudpickle_writes() -> None:
    # The executor protocol promises a cloudpickle; the worker writes it with the standard pickler
    # (faster), which is byte for byte the same for a runner by reference and a spec of plain data.
    import cloudpickle
    from readie_executor.jobs import run_job
    from readie_worker.jobs import runner_call

    job = CodeJob("base", "print(1)", env={"A": "b"}, files=())
    spec = job.spec((), session=True)
    assert runner_call(job, (), session=True) == cloudpickle.dumps({"func": run_job, "args": (spec,), "kwargs": {}})
