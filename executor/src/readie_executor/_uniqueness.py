"""Uniqueness after restore: no two sandboxes woken from one image draw the same numbers.

A checkpoint freezes the template's memory, the state of every random number
generator in it included, so every sandbox restored from one image (and both
sides of a fork, and every resume of a hibernated session) would otherwise
continue the same sequences. At every wake-up, before the socket is bound and
so before any job code runs, :meth:`Reseeder.reseed` draws fresh seeds from
the new sandbox's ``os.urandom`` for:

* Python's ``random`` module (its shared instance behind ``random.random``,
  ``getrandbits``, ``choice``, ``shuffle``..., and so ``uuid.uuid1``'s
  clock sequence and the ``email`` package's boundaries and message ids);
* every other module-level generator of an imported module: a
  ``random.Random`` (not ``SystemRandom``, which keeps no state), and with
  numpy a ``RandomState`` (the legacy global one behind ``numpy.random.*``,
  which pandas' ``sample`` uses too), a ``Generator`` or a bit generator;
* state derived from randomness that the standard library caches:
  ``tempfile``'s name sequence, ``uuid``'s random node, ``multiprocessing``'s
  authentication key, and OpenSSL's generator (fresh input mixed in with
  ``RAND_add``) when ``ssl`` is imported;
* then the operator's after-restore hook, if the capture plan names one.

Which module-level generators exist is taken by a census where the image is
taken (at capture, and again at every hibernation, which may follow imports
a session made), so that a wake-up only re-seeds a short list instead of
walking every module again (about 5 ms with pandas). ``__main__`` is never
touched: a session's own generators are its state, and one it seeded
explicitly must keep its sequence.

What cannot be re-seeded, and why, is in docs/security.md and decision 23.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

__all__ = ["AFTER_RESTORE_VARIABLE", "Reseeder", "ReseedError", "resolve_hook"]

#: The capture environment's name for the operator's hook, ``module:callable``.
AFTER_RESTORE_VARIABLE = "READIE_AFTER_RESTORE"
# A seed of 256 bits: as much as random.seed() itself reads from urandom per call.
SEED_BYTES = 32


class ReseedError(Exception):
    """The sandbox could not be re-seeded: it must not serve (a half re-seeded one would)."""


Hook = Callable[[], object]


@dataclass(frozen=True, slots=True)
class GeneratorRef:
    """Where a module-level generator lives: looked up again at each wake-up, never held."""

    module: str
    attribute: str


@dataclass
class Reseeder:
    hook: Hook | None = None
    hook_name: str = ""
    generators: tuple[GeneratorRef, ...] = ()

    @classmethod
    def prepared(cls, hook_name: str) -> Reseeder:
        """Resolve the hook and take the census: called at the capture point, before the image."""
        reseeder = cls(resolve_hook(hook_name), hook_name)
        reseeder.take_census()
        return reseeder

    def take_census(self) -> None:
        self.generators = tuple(_module_generators())

    def reseed(self) -> None:
        """Give every generator the census found a fresh seed, then run the hook."""
        try:
            _reseed_standard_library()
            kinds = _generator_kinds()
            for ref in self.generators:
                module = sys.modules.get(ref.module)
                value = None if module is None else _namespace(module).get(ref.attribute)
                if value is not None and isinstance(value, kinds):
                    _reseed_one(value)
        except Exception as exc:
            raise ReseedError(f"cannot re-seed the random number generators: {type(exc).__name__}: {exc}") from None
        if self.hook is not None:
            try:
                self.hook()
            except BaseException as exc:
                raise ReseedError(
                    f"after-restore hook {self.hook_name} failed: {type(exc).__name__}: {exc}"
                ) from None


def resolve_hook(name: str) -> Hook | None:
    """``package.module:function`` (or ``package.module``, whose ``after_restore`` is called).

    Imported at the capture point, so that a wake-up reads nothing through
    the gofer and a hook that cannot be found fails the capture, not every
    sandbox.
    """
    if not name:
        return None
    module_name, _, attribute = name.partition(":")
    try:
        target: object = importlib.import_module(module_name)
        for part in (attribute or "after_restore").split("."):
            target = getattr(target, part)
    except Exception as exc:
        raise ReseedError(f"after-restore hook {name}: {type(exc).__name__}: {exc}") from None
    if not callable(target):
        raise ReseedError(f"after-restore hook {name} is not callable")
    return target  # type: ignore[return-value]


def _generator_kinds() -> tuple[type, ...]:
    # numpy is looked for, never imported: a sandbox without it holds none of its generators.
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is None:
        return (random.Random,)
    return (random.Random, numpy_random.RandomState, numpy_random.Generator, numpy_random.BitGenerator)


def _module_generators() -> Iterator[GeneratorRef]:
    kinds = _generator_kinds()
    for name, module in list(sys.modules.items()):
        if name == "__main__" or not isinstance(module, ModuleType):
            continue
        for attribute, value in list(_namespace(module).items()):
            # type() and a plain isinstance run no code of the value's: a job may have put anything here.
            if isinstance(value, kinds) and not isinstance(value, random.SystemRandom):
                yield GeneratorRef(name, attribute)


def _namespace(module: ModuleType) -> dict[str, object]:
    namespace = getattr(module, "__dict__", None)
    return namespace if isinstance(namespace, dict) else {}


def _reseed_one(generator: object) -> None:
    if isinstance(generator, random.Random):
        # The base class's seed: a subclass's own seed() may ignore a None, or want arguments.
        random.Random.seed(generator, int.from_bytes(os.urandom(SEED_BYTES), "big"))
        return
    numpy_random = sys.modules["numpy.random"]
    if isinstance(generator, numpy_random.RandomState):
        generator.seed()  # None: fresh entropy from the OS
    elif isinstance(generator, numpy_random.Generator):
        _fresh_bit_generator_state(generator.bit_generator)
    else:
        _fresh_bit_generator_state(generator)


def _fresh_bit_generator_state(bit_generator: object) -> None:
    # A bit generator cannot be re-seeded in place, but its state can be set:
    # to that of a new one of the same kind, seeded from the OS (SeedSequence reads secrets).
    bit_generator.state = type(bit_generator)().state  # type: ignore[attr-defined]


def _reseed_standard_library() -> None:
    random.seed(int.from_bytes(os.urandom(SEED_BYTES), "big"))
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        # Made again, with a Random of its own seeded from the OS, at the next temp name.
        tempfile._name_sequence = None  # type: ignore[attr-defined]
    uuid = sys.modules.get("uuid")
    if uuid is not None and getattr(uuid, "_node", None) is not None:
        uuid._node = None  # type: ignore[attr-defined]  # found again (a MAC, else random) at the next uuid1()
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = os.urandom(SEED_BYTES)
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        ssl.RAND_add(os.urandom(SEED_BYTES), float(SEED_BYTES))
