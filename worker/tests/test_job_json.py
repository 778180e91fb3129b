"""The session store's JSON form of a job carries its egress policy exactly (decision 35)."""

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
