"""readie capture pipeline: rootfs, checkpoints and the manifest workers trust."""
