"""readie's in-sandbox executor. Standard library and cloudpickle only."""

from .protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
