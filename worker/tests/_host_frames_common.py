"""What the ``test_host_frames_*`` modules share: the host functions their calls may name."""

from __future__ import annotations

DECLARED = frozenset({"search", "fetch"})
