"""readie: run untrusted Python in gVisor sandboxes restored from checkpoints."""
