"""Re-seeding at every wake-up (decision 23): the pure layer in process, the refusal in a real executor.

That restored sandboxes really draw different numbers is proven under runsc,
from real checkpoints: worker/tests/test_uniqueness_runsc.py.
"""

from __future__ import annotations

import random
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor.tests._executor_process import short_dir  # noqa: F401 - fixture
from readie_executor._uniqueness import AFTER_RESTORE_VARIABLE, GeneratorRef, Reseeder, ReseedError, resolve_hook
from readie_executor.testing import ExecutorExited, start_capture


@pytest.fixture
def module_with_generators() -> Iterator[types.ModuleType]:
    module = types.ModuleType("readie_test_generators")
    module.frozen = random.Random(1234)  # type: ignore[attr-defined]
    module.system = random.SystemRandom()  # type: ignore[attr-defined]
    module.not_a_generator = 1234  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def next_draws(generator: random.Random, state: object) -> tuple[float, float]:
    """What a generator in ``state`` draws next, and what ``generator`` draws now."""
    twin = random.Random()
    twin.setstate(state)  # type: ignore[arg-type]
    return twin.random(), generator.random()


def test_the_census_finds_module_level_generators_and_skips_system_random(module_with_generators):
    reseeder = Reseeder()
    reseeder.take_census()

    assert GeneratorRef("readie_test_generators", "frozen") in reseeder.generators
    assert GeneratorRef("random", "_inst") in reseeder.generators
    assert not [ref for ref in reseeder.generators if ref.module == "readie_test_generators" and ref.attribute != "frozen"]


def test_the_census_never_looks_into_main(monkeypatch):
    main = types.ModuleType("__main__")
    main.rng = random.Random(7)  # type: ignore[attr-defined]  # a session's own, seeded on purpose
    monkeypatch.setitem(sys.modules, "__main__", main)
    reseeder = Reseeder()
    reseeder.take_census()
    state = main.rng.getstate()  # type: ignore[attr-defined]

    reseeder.reseed()

    assert all(ref.module != "__main__" for ref in reseeder.generators)
    assert main.rng.getstate() == state  # type: ignore[attr-defined]


def test_a_reseed_moves_every_generator_of_the_census_and_the_shared_one(module_with_generators):
    reseeder = Reseeder()
    reseeder.take_census()
    frozen_state, shared_state = module_with_generators.frozen.getstate(), random.getstate()

    reseeder.reseed()

    before, after = next_draws(module_with_generators.frozen, frozen_state)
    assert before != after
    shared_before, shared_after = next_draws(random._inst, shared_state)  # type: ignore[attr-defined]
    assert shared_before != shared_after


def test_a_generator_rebound_after_the_census_is_looked_up_again(module_with_generators):
    reseeder = Reseeder()
    reseeder.take_census()
    module_with_generators.frozen = replacement = random.Random(99)
    state = replacement.getstate()

    reseeder.reseed()

    assert replacement.getstate() != state


def test_a_subclass_is_seeded_by_the_base_class_never_its_own_seed(module_with_generators):
    class Picky(random.Random):
        armed = False

        def seed(self, *args: object, **kwargs: object) -> None:
            assert not self.armed, "readie must not call a subclass's own seed()"
            super().seed(*args, **kwargs)  # type: ignore[arg-type]

    module_with_generators.frozen = picky = Picky(0)
    picky.armed = True
    state = random.Random.getstate(picky)
    reseeder = Reseeder()
    reseeder.take_census()

    reseeder.reseed()

    assert random.Random.getstate(picky) != state


def test_cached_derived_state_is_dropped():
    tempfile._get_candidate_names()  # makes the name sequence, as a template's import might
    assert tempfile._name_sequence is not None  # type: ignore[attr-defined]

    Reseeder().reseed()

    assert tempfile._name_sequence is None  # type: ignore[attr-defined]


def test_the_hook_runs_after_the_built_in_reseeding():
    seen = []
    state = random.getstate()
    reseeder = Reseeder(hook=lambda: seen.append(random.getstate() != state), hook_name="test:hook")

    reseeder.reseed()

    assert seen == [True]


@pytest.mark.parametrize("failure", [ValueError("no entropy"), SystemExit(3), KeyboardInterrupt()])
def test_a_failing_hook_is_a_reseed_error_naming_it(failure):
    def hook() -> None:
        raise failure

    with pytest.raises(ReseedError, match=rf"after-restore hook mine:hook failed: {type(failure).__name__}"):
        Reseeder(hook=hook, hook_name="mine:hook").reseed()


def test_a_broken_built_in_generator_is_a_reseed_error(monkeypatch):
    monkeypatch.setattr(random, "seed", None)  # what a session's job could do to itself

    with pytest.raises(ReseedError, match="cannot re-seed the random number generators: TypeError"):
        Reseeder().reseed()


def test_hook_names_resolve_to_a_callable():
    assert resolve_hook("") is None
    assert resolve_hook("gc:collect") is __import__("gc").collect
    assert resolve_hook("os.path:join") is __import__("os").path.join


@pytest.mark.parametrize(
    ("name", "complaint"),
    [
        ("readie_no_such_module:hook", "ModuleNotFoundError"),
        ("gc:no_such_function", "AttributeError"),
        ("gc", "AttributeError"),  # a bare module must have an after_restore function
        ("sys:maxsize", "is not callable"),
    ],
)
def test_a_hook_that_cannot_be_resolved_is_refused(name, complaint):
    with pytest.raises(ReseedError, match=complaint):
        resolve_hook(name)


# --- in a real executor process: the stdio capture point stands in for the restore ------------


def hook_package(directory: Path, body: str) -> dict[str, str]:
    (directory / "readie_test_hook.py").write_text(body)
    return {"PYTHONPATH": str(directory)}


def test_a_hook_that_fails_at_wake_up_refuses_the_sandbox_with_exit_4(short_dir: Path) -> None:
    env = hook_package(short_dir, "def after_restore():\n    raise RuntimeError('no licence server')\n")
    env[AFTER_RESTORE_VARIABLE] = "readie_test_hook"
    with start_capture(short_dir, env=env) as executor:
        executor.hand_over({"EXECUTOR_DIR": str(short_dir), "EXECUTOR_MODE": "sandbox"})

        assert executor.wait() == 4
        assert (
            "readie_executor: sandbox refused: after-restore hook readie_test_hook failed: "
            "RuntimeError: no licence server"
        ) in executor.stderr_text()
    assert not (short_dir / "executor.sock").exists()  # it never served


def test_a_hook_that_cannot_be_found_fails_the_capture_before_the_image(short_dir: Path) -> None:
    with pytest.raises(ExecutorExited) as info:
        with start_capture(short_dir, env={AFTER_RESTORE_VARIABLE: "readie_no_such_hook:run"}):
            pytest.fail("no capture point may be announced")

    assert info.value.returncode == 3
    assert "capture failed: after-restore hook readie_no_such_hook:run: ModuleNotFoundError" in info.value.stderr
