"""readie worker: restores gVisor sandboxes from checkpoints and runs jobs in them."""
