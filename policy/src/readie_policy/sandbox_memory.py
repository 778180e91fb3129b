"""How much memory one sandbox can give a job: what the config's ``memory`` keys are held to.

Every sandbox runs under a memory cgroup, the backstop: gVisor's sentry and
gofer and the job together. A job's own ``memory`` comes on top of what the
sandbox itself takes, so the most a job can be given is the backstop less
that share. A worker refuses a job asking for more (``Worker.memory_ceiling``,
which uses a checkpoint's measured share when its manifest has one); the
config lowers a ceiling past :data:`MAX_JOB_MEMORY` to it and refuses a
profile asking for more (``config_keys``), so that no job is refused for a
value the operator set.
"""

from __future__ import annotations

__all__ = ["MAX_JOB_MEMORY", "SANDBOX_MEMORY_BACKSTOP", "SANDBOX_OVERHEAD"]

#: The memory cgroup of every sandbox (a worker's ``sandbox_memory_bytes``):
#: past it the kernel kills the sandbox, whatever the job's own limit says.
SANDBOX_MEMORY_BACKSTOP = 4 * 1024**3
#: What gVisor's sentry and gofer take besides the job, for a checkpoint whose
#: manifest has no measurement (an idle pandas sandbox: 156 MB measured). A
#: measured checkpoint's share, its idle memory and a slack, is smaller.
SANDBOX_OVERHEAD = 256 * 1024**2
#: The most memory a job can be given, whatever checkpoint serves it.
MAX_JOB_MEMORY = SANDBOX_MEMORY_BACKSTOP - SANDBOX_OVERHEAD
