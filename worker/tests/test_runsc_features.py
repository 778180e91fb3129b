"""Which flags a runsc binary gets, read from its own help: Debian 12's (2022) and trixie's (2024).

The help texts in runsc_help/ were printed by those two binaries (``runsc flags``,
``runsc help checkpoint``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from readie_worker.runsc import COMMON_FLAGS, RunscFeatures, parse_compressions, parse_platforms

HELP = Path(__file__).parent / "runsc_help"


def features_of(release: str) -> RunscFeatures:
    return RunscFeatures(
        version=f"runsc version 0.0~{release}.0",
        platforms=parse_platforms((HELP / f"{release}-flags.txt").read_text()),
        compressions=parse_compressions((HELP / f"{release}-checkpoint.txt").read_text()),
    )


def test_runsc_2024_gets_systrap_and_uncompressed_checkpoints():
    found = features_of("20240729")
    assert found.platforms == ("systrap", "ptrace", "kvm")
    assert found.compressions == ("none", "flate-best-speed")
    assert found.sandbox_flags == ("--platform=systrap", *COMMON_FLAGS)
    assert found.checkpoint_flags == ("--compression=none",)


def test_debian_12s_runsc_2022_keeps_ptrace_and_its_compressed_checkpoints():
    found = features_of("20221219")
    assert found.platforms == ("ptrace", "kvm")
    assert found.compressions == ()
    assert found.sandbox_flags == ("--platform=ptrace", *COMMON_FLAGS)
    assert found.checkpoint_flags == ()


@pytest.mark.parametrize(
    ("listed", "chosen"),
    [
        (("kvm",), "ptrace"),  # KVM hangs at boot on these VMs: never chosen
        ((), "ptrace"),  # help that could not be read: the platform every runsc has
        (("ptrace", "systrap"), "systrap"),
    ],
)
def test_the_platform_is_the_best_one_offered_and_never_kvm(listed, chosen):
    assert RunscFeatures("runsc version x", listed, ()).platform == chosen


def test_help_that_names_no_platforms_or_compressions_parses_to_nothing():
    assert parse_platforms("Usage: runsc <flags>\n") == ()
    assert parse_compressions("checkpoint [flags] <container id>\n  -image-path string\n") == ()
