"""Request lines: what the client sends, checked against the pool's own parser as the oracle."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from readie import MAX_LINE_BYTES, RequestError
from readie._requests import (
    cancel_request,
    close_request,
    job_request,
    session_setup,
    stats_request,
    step_request,
)
from readie._session_images import fork_request, hibernate_request
from readie._transfers import download_request, list_request
from readie_protocol.transfers import UploadChunk
from readie_protocol.workspace import MAX_REQUEST_FILES_BYTES, UPLOAD_CHUNK_BYTES
from readie_protocol.connection import PoolConnection, Role
from readie_pool.sans_io import MAX_LINE_BYTES as POOL_MAX_LINE_BYTES
from readie_pool.sans_io import Line, LineSplitter, OversizeLine
from readie_pool.sans_io import JobRequest, Refused, StatsRequest, parse_request

# {"id":1,"code":""} around the code
OVERHEAD = len(b'{"id":1,"code":""}')


def line(request: object) -> bytes:
    """What the client writes for ``request``: its line through the client's side of the connection."""
    return PoolConnection(Role.CLIENT).send(request)


def test_only_what_was_given_goes_on_the_wire_and_the_id_comes_first():
    assert line(job_request(1, "print(1)")) == b'{"id":1,"code":"print(1)"}\n'
    assert line(stats_request("s1")) == b'{"id":"s1","stats":true}\n'
    # Defaults are left out, so the pool's defaults and profiles apply to them.
    assert job_request(7, "pass", allow_network=False, args=(), env=None).fields == {"code"}
    assert list(json.loads(line(job_request(7, "pass", allow_network=False, args=(), env=None)))) == ["id", "code"]


def test_allow_network_takes_true_or_destinations():
    assert json.loads(line(job_request(1, "pass", allow_network=True)))["allow_network"] is True
    listed = job_request(1, "pass", allow_network=("api.example.com:443", "*.pypi.org"))
    assert listed.allow_network == ("api.example.com:443", "*.pypi.org")
    assert json.loads(line(listed))["allow_network"] == ["api.example.com:443", "*.pypi.org"]
    assert "allow_network" not in json.loads(line(job_request(1, "pass", allow_network=[])))
    with pytest.raises(RequestError, match="at most 64"):
        job_request(1, "pass", allow_network=[f"h{i}.example.com" for i in range(65)])


def test_every_field_as_the_pool_parses_it(tmp_path):
    request = job_request(
        "task-2", script=Path("app.py"), name="app.py", args=("one",), allow_read=[tmp_path / "data"],
        allow_write=["out"], package_dirs=["/srv/site"], env={"KEY": "value"}, allow_network=True,
        timeout=1.5, memory="512m", max_output=65536, max_file_size="1m", profile="analysis", packages=["attrs==23.1"],
    )
    assert request == JobRequest(
        id="task-2", script="app.py", name="app.py", args=("one",), allow_read=(str(tmp_path / "data"),),
        allow_write=("out",), package_dirs=("/srv/site",), env=(("KEY", "value"),), allow_network=True,
        timeout_ms=1500, memory_bytes=512 * 1024**2, max_output=65536, max_file_size=1024**2, profile="analysis",
        packages=("attrs==23.1",), fields=request.fields,
    )
    assert next(iter(json.loads(line(request)))) == "id"
    assert parse_request(line(request).rstrip(b"\n")) == request
    assert parse_request(line(stats_request(3)).rstrip(b"\n")) == StatsRequest(3)


@pytest.mark.parametrize(
    ("timeout", "ms"),
    [(5, 5000), ("250ms", 250), (1.1, 1100), (0.0001, 1), (timedelta(minutes=2), 120_000)],
)
def test_durations(timeout, ms):
    assert job_request(1, "pass", timeout=timeout).timeout_ms == ms


def test_what_the_pool_would_refuse_is_refused_by_its_own_checks_before_sending():
    # One definition: build_job is the parser's check of each field, named as the pool names it.
    for kwargs, field, message in [
        ({"timeout": "soon"}, "timeout", "timeout: "),
        ({"timeout": 0}, "timeout", "timeout: "),
        ({"max_output": "1g"}, "max_output", "max_output: "),
        ({"name": "n" * 256}, "name", "name: "),
    ]:
        with pytest.raises(RequestError, match=message) as refused:
            job_request(1, "pass", **kwargs)
        assert refused.value.field == field
        (refusal,) = [parse_request(json.dumps({"id": 1, "code": "pass", **kwargs}))]
        assert isinstance(refusal, Refused) and str(refusal.error) == str(refused.value)
    with pytest.raises(RequestError) as refused:
        session_setup(memory="lots")
    assert refused.value.field == "memory"


# What the client wrote before its requests were the protocol's typed values (dicts built here).
# What it writes now may spell a value another way ("5s" for 5, bytes for "512m"), but the pool
# reads every line back as the same request.
BEFORE = [
    ("job_code", b'{"id":1,"code":"print(1)"}'),
    ("job_all", b'{"id":"t-2","script":"app.py","name":"app.py","args":["one","two"],"allow_read":["/data"],'
     b'"allow_write":["out"],"package_dirs":["/srv/site"],"env":{"KEY":"value"},"allow_network":true,'
     b'"timeout":"1500ms","memory":"512m","max_output":65536,"max_file_size":"1m","profile":"analysis",'
     b'"packages":["attrs==23.1"],"functions":["search"],"stream":true,"report_files":true}'),
    ("job_timeout_int", b'{"id":2,"code":"pass","timeout":5}'),
    ("job_timeout_str", b'{"id":3,"code":"pass","timeout":"250ms"}'),
    ("job_timeout_small", b'{"id":4,"code":"pass","timeout":"1ms"}'),
    ("job_timeout_td", b'{"id":5,"code":"pass","timeout":"120000ms"}'),
    ("job_sizes", b'{"id":6,"code":"pass","memory":1073741824,"max_output":"64k","max_file_size":0}'),
    ("step_first", b'{"id":7,"code":"x = 1","session":"s","allow_read":["data"],"allow_write":["out"],'
     b'"package_dirs":["/srv/site"],"env":{"K":"v"},"allow_network":true,"timeout":"2500ms","memory":"512m",'
     b'"max_output":65536,"max_file_size":"1m","profile":"p","packages":["attrs==23.1"],"functions":["search"]}'),
    ("step_first_override", b'{"id":8,"code":"x","name":"n.py","args":["a"],"stream":true,"report_files":true,'
     b'"session":"s","allow_read":["data"],"allow_write":["out"],"package_dirs":["/srv/site"],"env":{"K":"v"},'
     b'"allow_network":true,"timeout":"250ms","memory":"512m","max_output":100,"max_file_size":"1m","profile":"p",'
     b'"packages":["attrs==23.1"],"functions":["search"]}'),
    ("step_later", b'{"id":9,"code":"x","session":"s"}'),
    ("cancel", b'{"id":10,"cancel":9}'),
    ("close", b'{"id":11,"session":"s","close":true}'),
    ("stats", b'{"id":"s1","stats":true}'),
    ("hibernate", b'{"id":12,"session":"s","hibernate":true}'),
    ("fork", b'{"id":13,"session":"s","fork":"s2"}'),
]


def calls():
    setup = session_setup(
        allow_read=[Path("data")], allow_write=["out"], package_dirs=["/srv/site"], env={"K": "v"},
        allow_network=True, timeout=2.5, memory="512m", max_output=65536, max_file_size="1m", profile="p",
        packages=["attrs==23.1"], functions={"search": None},
    )
    return {
        "job_code": job_request(1, "print(1)"),
        "job_all": job_request(
            "t-2", script=Path("app.py"), name="app.py", args=("one", "two"), allow_read=[Path("/data")],
            allow_write=["out"], package_dirs=["/srv/site"], env={"KEY": "value"}, allow_network=True, timeout=1.5,
            memory="512m", max_output=65536, max_file_size="1m", profile="analysis", packages=["attrs==23.1"],
            functions=["search"], stream=True, report_files=True,
        ),
        "job_timeout_int": job_request(2, "pass", timeout=5),
        "job_timeout_str": job_request(3, "pass", timeout="250ms"),
        "job_timeout_small": job_request(4, "pass", timeout=0.0001),
        "job_timeout_td": job_request(5, "pass", timeout=timedelta(minutes=2)),
        "job_sizes": job_request(6, "pass", memory=1 << 30, max_output="64k", max_file_size=0),
        "step_first": step_request(7, "s", "x = 1", setup=setup),
        "step_first_override": step_request(
            8, "s", "x", name="n.py", args=["a"], timeout=0.25, max_output=100, setup=setup, stream=True,
            report_files=True,
        ),
        "step_later": step_request(9, "s", "x"),
        "cancel": cancel_request(10, 9),
        "close": close_request(11, "s"),
        "stats": stats_request("s1"),
        "hibernate": hibernate_request(12, "s"),
        "fork": fork_request(13, "s", "s2"),
    }


def test_every_line_the_client_writes_reads_as_the_line_it_wrote_before():
    now = calls()
    assert sorted(now) == sorted(name for name, _ in BEFORE)
    for name, before in BEFORE:
        written = line(now[name])
        assert written.endswith(b"\n") and next(iter(json.loads(written))) == "id"
        assert parse_request(written.rstrip(b"\n")) == parse_request(before), name
        assert parse_request(written.rstrip(b"\n")) == now[name], name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allow_read": "data"}, r"allow_read: expected a list, got a single str; write allow_read=\['data'\]"),
        ({"args": "one"}, "args: expected a list"),
        ({"timeout": True}, "got a bool"),
        ({"memory": 1.5}, "memory: expected bytes"),
        ({"allow_write": [b"out"]}, "allow_write: expected a str or a path, got bytes"),
        ({"allow_network": 1}, "allow_network: expected True, False or a list of destinations, got int"),
        ({"allow_network": "api.example.com"}, r"allow_network: expected a list, got a single str"),
        ({"allow_network": [443]}, "allow_network: expected a str, got int"),
    ],
)
def test_python_type_mistakes_are_type_errors(kwargs, message):
    with pytest.raises(TypeError, match=message):
        job_request(1, "pass", **kwargs)


def test_exactly_one_of_code_and_script():
    for kwargs, field in (({}, "code"), ({"code": "pass", "script": "app.py"}, "script")):
        with pytest.raises(RequestError, match="exactly one of code and script") as refused:
            job_request(1, **kwargs)
        assert refused.value.field == field


def test_the_1_mib_limit_is_the_pools_own_and_matches_to_the_byte():
    assert MAX_LINE_BYTES == POOL_MAX_LINE_BYTES == 1024 * 1024
    largest = line(job_request(1, "x" * (MAX_LINE_BYTES - OVERHEAD)))
    assert len(largest) == MAX_LINE_BYTES + 1  # the newline is not counted
    assert LineSplitter().feed(largest) == [Line(largest[:-1])]
    with pytest.raises(RequestError) as refused:
        line(job_request(1, "x" * (MAX_LINE_BYTES - OVERHEAD + 1)))
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
    assert len(line(job_request(1, euro * fits))) <= MAX_LINE_BYTES + 1
    with pytest.raises(RequestError, match="1 MiB"):
        line(job_request(1, euro * (fits + 1)))


def test_text_utf8_cannot_carry_is_refused_naming_the_field():
    with pytest.raises(RequestError, match="lone surrogate") as refused:
        line(job_request(1, "print('\ud800')"))
    assert refused.value.field == "code"
    # The pool would refuse it too, had it been sent with an escape.
    assert isinstance(parse_request(b'{"id":1,"code":"\\ud800"}'), Refused)


def test_files_go_as_base64_and_collect_as_a_list_and_the_pool_reads_them_back():
    request = job_request(1, "pass", files={"data//orders.csv": b"a,b\n", "raw": bytearray(b"\x00\xff")},
                          collect=("out/*.png", "report.xlsx"))
    written = json.loads(line(request))
    assert written["files"] == {"data/orders.csv": "YSxiCg==", "raw": "AP8="}
    assert written["collect"] == ["out/*.png", "report.xlsx"]
    assert request.files == (("data/orders.csv", b"a,b\n"), ("raw", b"\x00\xff")) and list(request.collect) == written["collect"]
    assert parse_request(line(request).rstrip(b"\n")) == request
    step = step_request(2, "nb", "pass", files={"a": b""}, collect=["**/*.csv"])  # a later step may carry both
    assert parse_request(line(step).rstrip(b"\n")) == step and step.files == (("a", b""),)
    assert "files" not in job_request(3, "pass", files={}).fields


@pytest.mark.parametrize(("kwargs", "field", "message"), [
    ({"files": {"../x": b""}}, "files", "'..'"),
    ({"files": {"a": b"", "./a": b""}}, "files", "which another entry names too"),
    ({"files": {"big": bytes(MAX_REQUEST_FILES_BYTES + 1)}}, "files", "send larger files into a session"),
    ({"collect": ["/etc/*"]}, "collect", "absolute"),
])
def test_bad_files_and_collect_are_refused_naming_the_field(kwargs, field, message):
    with pytest.raises(RequestError, match=message) as refused:
        job_request(1, "pass", **kwargs)
    assert refused.value.field == field


def test_a_files_value_must_be_bytes_and_collect_a_list():
    with pytest.raises(TypeError, match=r"files\['a'\]: expected bytes, got str; encode text first"):
        job_request(1, "pass", files={"a": "text"})
    with pytest.raises(TypeError, match="collect: expected a list"):
        job_request(1, "pass", collect="*.png")


def test_a_sessions_transfer_lines_read_back_as_the_requests_they_are():
    for request in (
        download_request(4, "nb", "out//a.bin", 1024), list_request(5, "nb", "."),
        UploadChunk(6, "nb", "in.bin", UPLOAD_CHUNK_BYTES, UPLOAD_CHUNK_BYTES + 3, b"xyz"),
        UploadChunk(7, "nb", "in.bin", 0, UPLOAD_CHUNK_BYTES, bytes(UPLOAD_CHUNK_BYTES)),
    ):
        written = line(request)
        assert len(written) <= MAX_LINE_BYTES and parse_request(written.rstrip(b"\n")) == request
