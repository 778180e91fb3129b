"""The ``readie`` command itself: help, version, usage errors, and that help imports no component."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from readie.cli import SUBCOMMANDS, main, version_line
from readie_protocol.wire import PROTOCOL_VERSION
from readie_policy.cli_flags import duration_seconds


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_subcommand_on_stdout(capsys, flag):
    code, out, err = run(capsys, flag)
    assert (code, err) == (0, "")
    for name, sub in SUBCOMMANDS.items():
        assert any(line.split(None, 1) == [name, sub.summary] for line in out.splitlines()), name
    assert "mcp" in SUBCOMMANDS and SUBCOMMANDS["mcp"].summary == "a Model Context Protocol server (run_python tool)"


def test_no_arguments_print_the_help_on_stderr_and_exit_2(capsys):
    code, out, err = run(capsys)
    assert (code, out) == (2, "") and "subcommands:" in err and "  pool " in err


def test_version_names_the_distribution_and_the_protocol(capsys):
    code, out, err = run(capsys, "--version")
    assert (code, err) == (0, "") and out == version_line() + "\n"
    assert out.startswith("readie 0.") and out.endswith(f"(pool protocol {PROTOCOL_VERSION})\n")


@pytest.mark.parametrize(("arg", "what"), [("pols", "subcommand"), ("--verbose", "option")])
def test_an_unknown_subcommand_says_so(capsys, arg, what):
    code, out, err = run(capsys, arg)
    assert (code, out) == (2, "") and f"unknown {what} {arg!r}" in err and "readie --help" in err


def test_help_and_version_import_no_component():
    # The mcp module may not be installed (or written) yet; help must not care.
    probe = (
        "import sys; from readie.cli import main, SUBCOMMANDS; main(['--help']); main(['--version']); "
        "loaded = [m for m in {s.module for s in SUBCOMMANDS.values()} if m in sys.modules]; "
        "sys.stderr.write(repr(loaded))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr == "[]"


def test_durations_read_alike_on_every_command():
    assert [duration_seconds(text) for text in ("10s", "500ms", "2m", "30", "0.2", "0")] == [10, 0.5, 120, 30, 0.2, 0]
    for bad in ("-1", "inf", "nan", "10 s", "ten"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration_seconds(bad)


def test_worker_and_router_take_the_same_flag_spellings():
    from readie_router.cli import build_parser as router_parser
    from readie_worker.cli import build_parser as worker_parser

    worker = worker_parser().parse_args(["--drain-grace=30s", "--drain-notice=500ms", "--log=json", "--checkpoints=/x"])
    assert (worker.drain_grace, worker.drain_notice, worker.log, str(worker.checkpoints)) == (30, 0.5, "json", "/x")
    assert str(worker_parser().parse_args(["--manifest=/y/manifest.json"]).checkpoints) == "/y/manifest.json"
    router = router_parser().parse_args(["--probe-interval=200ms", "--drain-grace=10s", "--log=console"])
    assert (router.probe_interval, router.drain_grace, router.log, router.checkpoints) == (0.2, 10, "console", None)
