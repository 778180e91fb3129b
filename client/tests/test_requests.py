"""Request lines: what the client sends, checked against the pool's own parser as the oracle."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from readie import MAX_LINE_BYTES, RequestError
from readie._requests import job_request, stats_request
from readie_protocol.requests import encode_request
from readie_pool.sans_io import MAX_LINE_BYTES as POOL_MAX_LINE_BYTES
from readie_pool.sans_io import Line, LineSplitter, OversizeLine
from readie_pool.sans_io import JobRequest, Refused, StatsRequest, parse_request

# {"id":1,"code":""} around the code
OVERHEAD = len(b'{"id":1,"code":""}')


def test_only_what_was_given_goes_on_the_wire_and_the_id_comes_first():
    assert encode_request(job_request(1, "print(1)")) == b'{"id":1,"code":"print(1)"}\n'
    assert encode_request(stats_request("s1")) == b'{"id":"s1","stats":true}\n'
    # Defaults are left out, so the pool's defaults and profiles apply to them.
    assert list(job_request(7, "pass", allow_network=False, args=(), env=None)) == ["id", "code"]


def test_every_field_as_the_pool_parses_it(tmp_path):
    request = job_request(
        "task-2", script=Path("app.py"), name="app.py", args=("one",), allow_read=[tmp_path / "data"],
        allow_write=["out"], package_dirs=["/srv/site"], env={"KEY": "value"}, allow_network=True,
        timeout=1.5, memory="512m", max_output=65536, max_file_size="1m", profile="analysis", packages=["attrs==23.1"],
    )
    assert next(iter(request)) == "id"
    parsed = parse_request(encode_request(request).rstrip(b"\n"))
    assert parsed == JobRequest(
        id="task-2", script="app.py", name="app.py", args=("one",), allow_read=(str(tmp_path / "data"),),
        allow_write=("out",), package_dirs=("/srv/site",), env=(("KEY", "value"),), allow_network=True,
        timeout_ms=1500, memory_bytes=512 * 1024**2, max_output=65536, max_file_size=1024**2, profile="analysis",
        packages=("attrs==23.1",), fields=frozenset(request) - {"id"},
    )
    assert parse_request(encode_request(stats_request(3)).rstrip(b"\n")) == StatsRequest(3)


@pytest.mark.parametrize(
    ("timeout", "wire", "ms"),
    [(5, 5, 5000), ("250ms", "250ms", 250), (1.1, "1100ms", 1100), (0.0001, "1ms", 1),
     (timedelta(minutes=2), "120000ms", 120_000)],
)
def test_durations(timeout, wire, ms):
    request = job_request(1, "pass", timeout=timeout)
    assert request["timeout"] == wire
    parsed = parse_request(json.dumps(request))
    assert isinstance(parsed, JobRequest) and parsed.timeout_ms == ms


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allow_read": "data"}, r"allow_read: expected a list, got a single str; write allow_read=\['data'\]"),
        ({"args": "one"}, "args: expected a list"),
        ({"timeout": True}, "got a bool"),
        ({"memory": 1.5}, "memory: expected bytes"),
        ({"allow_write": [b"out"]}, "allow_write: expected a str or a path, got bytes"),
        ({"allow_network": 1}, "allow_network: expected True or False"),
    ],
)
def test_python_type_mistakes_are_type_errors(kwargs, message):
    with pytest.raises(TypeError, match=message):
        job_request(1, "pass", **kwargs)


def test_exactly_one_of_code_and_script():
    for kwargs in ({}, {"code": "pass", "script": "app.py"}):
        with pytest.raises(RequestError, match="exactly one of code and script") as refused:
            job_request(1, **kwargs)
        assert refused.value.field == "code"


def test_the_1_mib_limit_is_the_pools_own_and_matches_to_the_byte():
    assert MAX_LINE_BYTES == POOL_MAX_LINE_BYTES == 1024 * 1024
    largest = encode_request(job_request(1, "x" * (MAX_LINE_BYTES - OVERHEAD)))
    assert len(largest) == MAX_LINE_BYTES + 1  # the newline is not counted
    assert LineSplitter().feed(largest) == [Line(largest[:-1])]
    with pytest.raises(RequestError) as refused:
        encode_request(job_request(1, "x" * (MAX_LINE_BYTES - OVERHEAD + 1)))
    assert refused.value.field == "code"
    assert str(refused.value) == (
        f"code: the request line is {MAX_LINE_BYTES + 1} bytes, {MAX_LINE_BYTES - OVERHEAD + 3} of them code; "
        f"the pool reads at most {MAX_LINE_BYTES} bytes (1 MiB) per line (pass long code as a file with "
        "script=...); put large data in a file under allow_read instead"
    )
    # The pool would have discarded it: the client's check only says so sooner.
    assert LineSplitter().feed(b'{"id":1,"code":"' + b"x" * (MAX_LINE_BYTES - OVERHEAD + 1) + b'"}\n') == [
        OversizeLine(size=MAX_LINE_BYTES + 1, id=1)
    ]


def test_the_limit_counts_utf8_bytes_not_characters():
    euro = "€"  # three bytes in UTF-8
    fits = (MAX_LINE_BYTES - OVERHEAD) // 3
    assert len(encode_request(job_request(1, euro * fits))) <= MAX_LINE_BYTES + 1
    with pytest.raises(RequestError, match="1 MiB"):
        encode_request(job_request(1, euro * (fits + 1)))


def test_text_utf8_cannot_carry_is_refused_naming_the_field():
    with pytest.raises(RequestError, match="lone surrogate") as refused:
        encode_request(job_request(1, "print('\ud800')"))
    assert refused.value.field == "code"
    # The pool would refuse it too, had it been sent with an escape.
    assert isinstance(parse_request(b'{"id":1,"code":"\\ud800"}'), Refused)
