"""Policy resolution: profile, then request, then the ceiling."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from readie_worker.errors import RequestError
from readie_policy.egress import Egress, parse_destinations
from readie_policy.jobs import CodeJob, Step
from readie_policy.policy import (
    DEFAULT_MAX_FILE_SIZE,
    DEFAULT_MAX_OUTPUT,
    DEFAULT_MEMORY_BYTES,
    DEFAULT_TIMEOUT_MS,
    NO_LIMITS,
    NOTHING_GRANTED,
    Limits,
    Policy,
    Profile,
    resolve_path,
    resolve_policy,
    resolve_script,
    check_step,
)
from readie_protocol.requests import JobRequest, parse_request
from readie_protocol.workspace import MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_TRANSFER_BYTES

GIB = 1024**3
MIB = 1024**2

# The spec's [pool.limits] and profiles, as _config builds them.
SPEC_LIMITS = Limits(
    allow_read=(Path("/srv/agent/data"),),
    allow_write=(Path("/srv/agent/work"),),
    allow_network=False,
    timeout_ms=30_000,
    memory_bytes=GIB,
    max_output=1048576,
    max_file_size=256 * MIB,
)
SPEC_PROFILES = {
    "analysis": Profile(
        name="analysis",
        allow_read=(Path("/srv/agent/data"),),
        allow_write=(Path("/srv/agent/work"),),
    ),
    "fetch": Profile(name="fetch", allow_network=True),
}


def lexical(path: str) -> str:
    return os.path.normpath(path)


def job(line: str) -> JobRequest:
    request = parse_request(line.encode())
    assert isinstance(request, JobRequest), request
    return request


def policy(line: str, cwd: str = "/srv/agent", **kwargs: object) -> Policy:
    kwargs.setdefault("resolve", lexical)
    return resolve_policy(job(line), cwd=cwd, **kwargs)  # type: ignore[arg-type]


def refused(line: str, cwd: str = "/srv/agent", **kwargs: object) -> RequestError:
    with pytest.raises(RequestError) as info:
        policy(line, cwd, **kwargs)
    return info.value


def test_defaults_without_a_ceiling() -> None:
    assert policy('{"id": 1, "code": "x"}') == Policy()
    assert Policy() == Policy(
        allow_read=(), allow_write=(), package_dirs=(), env=(), network=False,
        timeout_ms=30_000, memory_bytes=None, max_output=1024 * 1024,
        max_file_size=None,
    )
    assert (DEFAULT_TIMEOUT_MS, DEFAULT_MEMORY_BYTES, DEFAULT_MAX_OUTPUT, DEFAULT_MAX_FILE_SIZE) == (
        30_000, None, 1024 * 1024, None,
    )


def test_spec_task_1_resolves_against_the_caller_directory() -> None:
    line = r"""{"id": "task-1", "code": "import json\nprint(json.dumps({'ok': True}))", "name": "step.py", "allow_write": ["out"]}"""
    assert policy(line, cwd="/abs").allow_write == (Path("/abs/out"),)


def test_spec_task_2_without_a_ceiling() -> None:
    line = r"""{"id": "task-2", "script": "app.py", "args": ["one"], "allow_read": ["data"], "package_dirs": [], "env": {"KEY": "value"}, "allow_network": false, "timeout": "5s", "memory": "512m", "max_output": 65536}"""
    assert policy(line, cwd="/home/me") == Policy(
        allow_read=(Path("/home/me/data"),),
        env=(("KEY", "value"),),
        timeout_ms=5000,
        memory_bytes=512 * MIB,
        max_output=65536,
    )


def test_spec_task_2_within_the_spec_ceiling() -> None:
    line = r"""{"id": "task-2", "script": "app.py", "args": ["one"], "allow_read": ["data"], "package_dirs": [], "env": {"KEY": "value"}, "allow_network": false, "timeout": "5s", "memory": "512m", "max_output": 65536}"""
    result = policy(line, limits=SPEC_LIMITS)
    assert result.allow_read == (Path("/srv/agent/data"),)
    # max_file_size: the ceiling's applies to a request that sets none.
    assert (result.timeout_ms, result.memory_bytes, result.max_output, result.max_file_size) == (
        5000, 512 * MIB, 65536, 256 * MIB,
    )


def test_unset_values_take_the_smaller_of_default_and_ceiling() -> None:
    result = policy('{"id": 1, "code": "x"}', limits=SPEC_LIMITS)
    assert (result.timeout_ms, result.memory_bytes, result.max_output, result.max_file_size) == (
        30_000, GIB, 1048576, 256 * MIB,
    )
    tight = Limits(timeout_ms=10_000, max_output=100)
    result = policy('{"id": 1, "code": "x"}', limits=tight)
    assert (result.timeout_ms, result.max_output) == (10_000, 100)
    loose = Limits(timeout_ms=3_600_000, max_output=10 * MIB)
    result = policy('{"id": 1, "code": "x"}', limits=loose)
    assert (result.timeout_ms, result.max_output) == (DEFAULT_TIMEOUT_MS, DEFAULT_MAX_OUTPUT)


def test_values_at_the_ceiling_are_accepted() -> None:
    result = policy(
        '{"id": 1, "code": "x", "timeout": "30s", "memory": "1g", "max_output": 1048576, "max_file_size": "256m"}',
        limits=SPEC_LIMITS,
    )
    assert (result.timeout_ms, result.memory_bytes, result.max_output, result.max_file_size) == (
        30_000, GIB, 1048576, 256 * MIB,
    )


@pytest.mark.parametrize(
    ("fields", "field", "text"),
    [
        ('"timeout": "31s"', "timeout", "31000 ms exceeds the pool's [pool.limits] timeout of 30000 ms"),
        ('"timeout": "1h"', "timeout", "exceeds"),
        ('"memory": "2g"', "memory", f"{2 * GIB} bytes exceeds the pool's [pool.limits] memory of {GIB} bytes"),
        ('"max_output": 1048577', "max_output", "exceeds"),
        ('"max_file_size": "257m"', "max_file_size", "exceeds"),
        ('"allow_network": true', "allow_network", "do not allow the network"),
        ('"allow_read": ["/etc"]', "allow_read", "'/etc' is not beneath a path the pool's [pool.limits] allow (/srv/agent/data, /srv/agent/work)"),
        # Quoted as the request wrote them, never as they resolve.
        ('"allow_read": ["data/../secret"]', "allow_read", "'data/../secret' is not beneath"),
        ('"allow_read": ["/srv/agent/data/../../../etc"]', "allow_read", "'/srv/agent/data/../../../etc' is not beneath"),
        ('"allow_read": ["/srv/agent/data2"]', "allow_read", "not beneath"),  # a prefix is not a parent
        ('"allow_read": ["/srv/agent"]', "allow_read", "not beneath"),
        ('"allow_write": ["data"]', "allow_write", "(/srv/agent/work)"),  # readable is not writable
        ('"allow_write": ["work", "/tmp"]', "allow_write", "'/tmp'"),
        ('"package_dirs": ["/usr/lib/python3/dist-packages"]', "package_dirs", "not beneath"),
        ('"profile": "admin"', "profile", "unknown profile 'admin' (known: analysis, fetch)"),
    ],
)
def test_outside_the_ceiling(fields: str, field: str, text: str) -> None:
    error = refused('{"id": 1, "code": "x", ' + fields + "}", limits=SPEC_LIMITS, profiles=SPEC_PROFILES)
    assert error.field == field
    assert text in str(error)
    assert str(error).startswith(f"{field}: ")


def test_within_the_ceiling() -> None:
    result = policy(
        '{"id": 1, "code": "x", "allow_read": ["data", "data/sub", "work/in"], '
        '"allow_write": ["work/out", "/srv/agent/work"], "package_dirs": ["data/site"]}',
        limits=SPEC_LIMITS,
    )
    assert result.allow_read == (
        Path("/srv/agent/data"), Path("/srv/agent/data/sub"), Path("/srv/agent/work/in"),
    )
    assert result.allow_write == (Path("/srv/agent/work/out"), Path("/srv/agent/work"))
    assert result.package_dirs == (Path("/srv/agent/data/site"),)


def test_an_empty_ceiling_allows_no_paths() -> None:
    error = refused('{"id": 1, "code": "x", "allow_read": ["."]}', limits=Limits(allow_read=(), allow_write=()))
    assert "(none)" in str(error)


def test_the_root_ceiling_allows_every_path() -> None:
    result = policy('{"id": 1, "code": "x", "allow_write": ["/etc"]}', limits=Limits(allow_write=(Path("/"),)))
    assert result.allow_write == (Path("/etc"),)


def test_no_ceiling_allows_everything() -> None:
    result = policy('{"id": 1, "code": "x", "allow_write": ["/"], "allow_network": true, "timeout": "1h"}')
    assert (result.allow_write, result.network, result.timeout_ms) == ((Path("/"),), True, 3_600_000)
    assert result.egress == Egress(public=True) and NO_LIMITS.allow_network is None


def test_package_dirs_may_lie_beneath_the_pool_package_dirs() -> None:
    result = policy(
        '{"id": 1, "code": "x", "package_dirs": ["/srv/site/extra"]}',
        limits=SPEC_LIMITS,
        protected=(Path("/srv/site"),),
    )
    assert result.package_dirs == (Path("/srv/site/extra"),)


@pytest.mark.parametrize("path", ["/srv/site", "/srv/site/pandas", "/srv", "/"])
def test_no_write_over_pool_package_dirs(path: str) -> None:
    error = refused(
        '{"id": 1, "code": "x", "allow_write": ["' + path + '"]}', protected=(Path("/srv/site"),)
    )
    assert error.field == "allow_write" and "package dir '/srv/site'" in str(error)


@pytest.mark.parametrize("path", ["data/escape", "data/escape/../data", "data/inside/sub", "data/inside"])
@pytest.mark.parametrize("ceiling", [True, False], ids=["ceiling", "no-ceiling"])
def test_a_request_path_through_a_symlink_is_refused_without_saying_where_it_leads(
    tmp_path: Path, path: str, ceiling: bool
) -> None:
    """A job can plant a symlink in a write grant; readie never follows one a request names,
    even one that leads beneath the ceiling, and the refusal quotes the request."""
    data = tmp_path / "data"
    secret = tmp_path / "s3cr3t-target"
    data.mkdir()
    secret.mkdir()
    (data / "escape").symlink_to(secret)
    (data / "inside").symlink_to(data / ".")
    limits = Limits(allow_read=(data,), allow_write=()) if ceiling else NO_LIMITS
    request = job('{"id": 1, "code": "x", "allow_read": ["' + path + '"]}')
    with pytest.raises(RequestError) as info:
        resolve_policy(request, cwd=tmp_path, limits=limits)
    assert info.value.field == "allow_read"
    assert str(info.value) == (
        f"allow_read: {path!r} passes through a symbolic link, which readie never follows in a granted path"
    )


def test_a_proc_magic_link_is_refused_without_naming_its_file(tmp_path: Path) -> None:
    with open(tmp_path / "pool-stderr", "w") as private:
        request = job('{"id": 1, "code": "x", "allow_read": ["/proc/self/fd/' + str(private.fileno()) + '"]}')
        with pytest.raises(RequestError) as info:
            resolve_policy(request, cwd="/")
    assert "pool-stderr" not in str(info.value) and "passes through a symbolic link" in str(info.value)


def test_a_symlink_free_request_path_is_kept_lexically(tmp_path: Path) -> None:
    (tmp_path / "data" / "sub").mkdir(parents=True)
    request = job('{"id": 1, "code": "x", "allow_read": ["data/sub/..", "missing/x", "//data"]}')
    assert resolve_policy(request, cwd=tmp_path).allow_read == (tmp_path / "data", tmp_path / "missing" / "x", Path("/data"))


def test_unresolvable_paths_are_refused() -> None:
    request = JobRequest(id=1, code="x", allow_read=("a\x00b",))
    with pytest.raises(RequestError) as info:
        resolve_policy(request, cwd="/")
    assert info.value.field == "allow_read"


def test_cwd_must_be_absolute() -> None:
    with pytest.raises(ValueError):
        resolve_path("x", "relative")


# --------------------------------------------------------------------------- profiles


def test_spec_profile_analysis() -> None:
    result = policy('{"id": 1, "code": "x", "profile": "analysis"}', limits=SPEC_LIMITS, profiles=SPEC_PROFILES)
    assert result.allow_read == (Path("/srv/agent/data"),)
    assert result.allow_write == (Path("/srv/agent/work"),)


def test_spec_profile_fetch_is_stopped_by_the_spec_ceiling() -> None:
    error = refused('{"id": 1, "code": "x", "profile": "fetch"}', limits=SPEC_LIMITS, profiles=SPEC_PROFILES)
    assert error.field == "allow_network"
    assert "(from profile 'fetch')" in str(error)
    # The request's own false wins over the profile's true.
    result = policy(
        '{"id": 1, "code": "x", "profile": "fetch", "allow_network": false}',
        limits=SPEC_LIMITS, profiles=SPEC_PROFILES,
    )
    assert result.network is False
    assert policy('{"id": 1, "code": "x", "profile": "fetch"}', profiles=SPEC_PROFILES).network is True


def test_a_request_list_lies_within_the_ceiling_and_a_profile_list_says_where_it_came_from() -> None:
    ceiling = Limits(allow_network=parse_destinations(["*.example.com:443", "10.1.0.0/16"]))
    profiles = {"api": Profile(name="api", allow_network=parse_destinations(["api.example.com"]))}
    result = policy('{"id": 1, "code": "x", "allow_network": ["API.example.com:443", "10.1.2.3"]}', limits=ceiling)
    assert result.network and result.egress is not None
    assert [str(d) for d in result.egress.destinations] == ["api.example.com:443", "10.1.2.3"]
    assert str(refused('{"id": 1, "code": "x", "profile": "api"}', limits=ceiling, profiles=profiles)) == (
        "allow_network: 'api.example.com' is not within the pool's [pool.limits] allow_network (from profile 'api')")
    assert str(refused('{"id": 1, "code": "x", "allow_network": ["a b"]}', limits=ceiling)).startswith(
        "allow_network: 'a b' is not a destination")
    assert refused('{"id": 1, "code": "x", "allow_network": ["api.example.com"]}', limits=SPEC_LIMITS).field == "allow_network"
    true = policy('{"id": 1, "code": "x", "allow_network": true}', limits=ceiling).egress
    assert true is not None and true.destinations == ceiling.allow_network
    assert policy('{"id": 1, "code": "x", "allow_network": []}', limits=ceiling).egress is None
    assert refused('{"id": 1, "code": "x", "allow_network": true}', limits=NOTHING_GRANTED).field == "allow_network"


def test_request_fields_go_on_top_of_the_profile() -> None:
    profile = Profile(
        name="p",
        allow_read=(Path("/srv/a"), Path("/srv/b")),
        allow_write=(Path("/srv/w"),),
        env=(("A", "1"), ("B", "2")),
        timeout_ms=10_000,
        memory_bytes=GIB,
        max_output=100,
    )
    result = policy(
        '{"id": 1, "code": "x", "profile": "p", "allow_read": ["/srv/b", "/srv/c"], '
        '"env": {"B": "3", "C": "4"}, "timeout": "20s"}',
        profiles={"p": profile},
    )
    assert result.allow_read == (Path("/srv/a"), Path("/srv/b"), Path("/srv/c"))
    assert result.allow_write == (Path("/srv/w"),)
    assert result.env == (("A", "1"), ("B", "3"), ("C", "4"))
    assert (result.timeout_ms, result.memory_bytes, result.max_output) == (20_000, GIB, 100)


def test_profile_values_over_the_ceiling_say_where_they_came_from() -> None:
    wide = Profile(name="wide", allow_read=(Path("/"),), timeout_ms=3_600_000)
    error = refused('{"id": 1, "code": "x", "profile": "wide"}', limits=SPEC_LIMITS, profiles={"wide": wide})
    assert error.field == "allow_read" and str(error).endswith("(from profile 'wide')")
    slow = Profile(name="slow", timeout_ms=3_600_000)
    error = refused('{"id": 1, "code": "x", "profile": "slow"}', limits=SPEC_LIMITS, profiles={"slow": slow})
    assert error.field == "timeout" and str(error).endswith("(from profile 'slow')")
    # A request value that fits replaces the profile's before the ceiling looks.
    assert policy(
        '{"id": 1, "code": "x", "profile": "slow", "timeout": "5s"}', limits=SPEC_LIMITS, profiles={"slow": slow}
    ).timeout_ms == 5000


def test_unknown_profile_without_profiles() -> None:
    error = refused('{"id": 1, "code": "x", "profile": "p"}')
    assert "known: none are configured" in str(error)


# --------------------------------------------------------------------------- scripts and steps


def test_resolve_script() -> None:
    request = job('{"id": 1, "script": "app.py", "allow_read": ["data"]}')
    assert resolve_script(request, cwd="/home/me", resolve=lexical) == Path("/home/me/app.py")
    assert resolve_script(job('{"id": 1, "code": "x"}'), cwd="/") is None
    # Beneath the ceiling, though not beneath the job's own grants (the spec's task-2).
    assert resolve_script(
        job('{"id": 1, "script": "data/app.py"}'), cwd="/srv/agent", limits=SPEC_LIMITS, resolve=lexical
    ) == Path("/srv/agent/data/app.py")
    with pytest.raises(RequestError) as info:
        resolve_script(job('{"id": 1, "script": "/etc/shadow"}'), cwd="/", limits=SPEC_LIMITS, resolve=lexical)
    assert info.value.field == "script"


def test_a_step_is_held_to_the_ceiling_and_takes_the_sessions_job_for_the_rest() -> None:
    check_step(20_000, 10, SPEC_LIMITS)
    check_step(None, None, SPEC_LIMITS)
    with pytest.raises(RequestError) as info:
        check_step(60_000, None, SPEC_LIMITS)
    assert info.value.field == "timeout"
    session = CodeJob("base", "x", allow_read=("/data",), timeout_ms=10_000, max_output=64)
    assert session.step(Step("y", timeout_ms=20_000, max_output=10)) == CodeJob(
        "base", "y", allow_read=("/data",), timeout_ms=20_000, max_output=10
    )
    assert session.step(Step("z")) == CodeJob("base", "z", allow_read=("/data",), timeout_ms=10_000, max_output=64)


# --------------------------------------------------------------------------- property


segments = st.lists(st.sampled_from(["data", "work", "..", ".", "x", "", "agent", "srv"]), min_size=1, max_size=6)


@given(st.lists(segments.map("/".join), min_size=1, max_size=3), st.booleans())
def test_granted_paths_always_lie_beneath_the_ceiling(paths: list[str], absolute: bool) -> None:
    texts = [("/" + p if absolute else p) or "." for p in paths]
    request = JobRequest(id=1, code="x", allow_read=tuple(texts), allow_write=tuple(texts))
    try:
        result = resolve_policy(request, cwd="/srv/agent/data", limits=SPEC_LIMITS, resolve=lexical)
    except RequestError as error:
        assert error.field in ("allow_read", "allow_write")
        return
    for path in result.allow_write:
        assert path.is_relative_to("/srv/agent/work")
    for path in result.allow_read:
        assert path.is_relative_to("/srv/agent/data") or path.is_relative_to("/srv/agent/work")
        assert ".." not in path.parts


def test_a_path_outside_the_ceiling_is_refused_without_being_looked_at(tmp_path: Path) -> None:
    """No oracle: whether a path elsewhere exists or is a symlink never shapes the answer."""
    (tmp_path / "data").mkdir()
    (tmp_path / "elsewhere").symlink_to("/etc")
    looked_at: list[str] = []

    def watching(path: str) -> str:
        looked_at.append(path)
        return os.path.realpath(path)

    limits = Limits(allow_read=(tmp_path / "data",), allow_write=())
    for path in ("elsewhere/passwd", "missing/x", "/proc/1/root/etc"):
        request = job('{"id": 1, "code": "x", "allow_read": ["' + path + '"]}')
        with pytest.raises(RequestError, match="is not beneath"):
            resolve_policy(request, cwd=tmp_path, limits=limits, resolve=watching)
    assert looked_at == []


def test_a_path_granted_both_ways_is_a_write_grant() -> None:
    result = policy('{"id": 1, "code": "x", "allow_read": ["work", "data"], "allow_write": ["work"]}', limits=SPEC_LIMITS)
    assert (result.allow_read, result.allow_write) == ((Path("/srv/agent/data"),), (Path("/srv/agent/work"),))


def test_a_job_under_a_policy_holds_its_grants_and_limits_as_the_worker_reads_them() -> None:
    granted = Policy(
        allow_read=(Path("/srv/data"),),
        allow_write=(Path("/srv/out"),),
        package_dirs=(Path("/srv/site"), Path("/opt/pool")),
        env=(("A", "1"),),
        network=True,
        timeout_ms=5000,
        memory_bytes=None,
        max_output=10,
        max_file_size=20,
    )
    job = CodeJob.under(granted, checkpoint="base", code="x", pool_package_dirs=(Path("/opt/pool"),))
    assert (job.allow_read, job.allow_write, job.env) == (("/srv/data",), ("/srv/out",), {"A": "1"})
    assert job.package_dirs == ("/opt/pool", "/srv/site")  # the pool's first, each once
    assert (job.network, job.timeout_ms, job.memory_bytes, job.max_output, job.max_file_size) == (True, 5000, None, 10, 20)


def test_what_comes_back_and_moves_is_the_ceilings_at_most_the_hard_maxima() -> None:
    request = parse_request('{"id": 1, "code": "x", "files": {"a": "aGk="}, "collect": ["out/*"]}')
    assert isinstance(request, JobRequest)
    unbounded = resolve_policy(request, cwd="/srv", resolve=None)
    assert (unbounded.collect_bytes, unbounded.collect_files, unbounded.transfer_bytes) == (
        MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_TRANSFER_BYTES)
    ceiling = Limits(collect_bytes=1000, collect_files=2, transfer_bytes=MAX_TRANSFER_BYTES * 2)
    policy = resolve_policy(request, cwd="/srv", limits=ceiling, resolve=None)
    job = CodeJob.under(policy, checkpoint="base", code="x", files=request.files, collect=request.collect)
    assert (job.collect_bytes, job.collect_files, job.transfer_bytes) == (1000, 2, MAX_TRANSFER_BYTES)
    assert (job.files, job.collect) == ((("a", b"hi"),), ("out/*",))
    # A step brings its own files and collect; what may come back stays the session's.
    stepped = job.step(Step(code="y", files=(("b", b""),)))
    assert (stepped.files, stepped.collect, stepped.collect_bytes) == ((("b", b""),), (), 1000)
