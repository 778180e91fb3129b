"""readie worker: restores gVisor sandboxes from checkpoints and runs jobs in them."""

from ._mounts import enter_mount_namespace

__all__ = ["enter_mount_namespace"]
