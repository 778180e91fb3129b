"""The demo behind `make run` (until `readie pool` lands): a worker with warm
pandas sandboxes runs one job per policy feature, then a cloudpickled call.

Every job runs in a gVisor sandbox restored from a checkpoint with pandas
already imported; the results printed are what the worker validated out of
the sandbox (hostile JSON, never a pickle).
"""

from __future__ import annotations

import pickle
import sys
import tempfile
from pathlib import Path

import cloudpickle

from readie_worker.core import Worker, WorkerConfig
from readie_worker.jobs import CodeJob
from readie_policy.locations import locate_checkpoints
from readie_policy.logs import configure_logging



def remote_groupby():
    import pandas as pd

    return pd.DataFrame({"k": ["a", "b", "a"], "v": [1, 2, 3]}).groupby("k").v.sum().to_dict()


def main() -> int:
    configure_logging(level="warning")
    work = Path(tempfile.mkdtemp(prefix="readie-demo-"))
    (work / "data").mkdir()
    (work / "out").mkdir()
    (work / "data" / "orders.csv").write_text("product,amount\ntea,3\ncake,5\ntea,4\njam,2\n")
    jobs = {
        "pandas groupby, read grant": dict(
            code="import pandas as pd\nprint(pd.read_csv('data/orders.csv').groupby('product').amount.sum().to_dict())",
            allow_read=(str(work / "data"),),
            cwd=str(work),
        ),
        "print (warm pool)": dict(code="import sys\nprint('pandas preloaded:', 'pandas' in sys.modules)"),
        "write grant lands on the host": dict(
            code=f"open({str(work / 'out' / 'report.txt')!r}, 'w').write('made in gVisor')",
            allow_write=(str(work / "out"),),
        ),
        "the host's files": dict(code="import os\nprint(open('/etc/hostname').read().strip(), os.path.exists('/work'))"),
        "write outside grants": dict(code="open('/etc/motd', 'w').write('x')"),
        "timeout 1s": dict(code="while True: pass", timeout_ms=1000),
        "memory 100 MB": dict(code="x = bytearray(500 * 1024 * 1024)", memory_bytes=100 * 1024 * 1024),
        "subprocess": dict(code="import subprocess\nsubprocess.run(['ls'])"),
    }
    # Found as every readie command finds them (docs/pool.md, "Where the checkpoints are").
    worker = Worker(WorkerConfig.in_temp(locate_checkpoints().manifest, warm={"pandas": 2})).start()
    try:
        worker.warm["pandas"].wait_until_full(timeout=60)
        for title, fields in jobs.items():
            outcome = worker.run_job(CodeJob(checkpoint="pandas", name="demo.py", **fields))
            error = f"{outcome.error.type}: {outcome.error.message}" if outcome.error else None
            print(
                f"{title:30} exit={outcome.exit} stdout={outcome.stdout.strip()!r} error={error!r} "
                f"[{outcome.backend}, {outcome.duration_us / 1000:.0f} ms]"
            )
        print(f"{'':30} the host's out/report.txt: {(work / 'out' / 'report.txt').read_text()!r}")
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        request = cloudpickle.dumps({"func": remote_groupby, "args": (), "kwargs": {}})
        envelope = pickle.loads(worker.execute_call("pandas", request, timeout_s=30))  # only the client unpickles
        print(f"{'cloudpickled call':30} {envelope}")
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
