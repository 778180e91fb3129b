"""readie's in-sandbox executor. Standard library and cloudpickle only."""

from ._calls import run_call
from ._checkpoint import READY_MARKER
from ._uniqueness import AFTER_RESTORE_VARIABLE
from .framing import PROTOCOL_VERSION

__all__ = ["AFTER_RESTORE_VARIABLE", "PROTOCOL_VERSION", "READY_MARKER", "run_call"]
