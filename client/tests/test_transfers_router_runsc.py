"""Files through ``readie.Pool(router=...)``: ``readie pool --router`` in front of a ``readie worker``
whose disk this client never touches (issue 29). A CSV goes in with ``files`` and is read by pandas;
the PNG and XLSX the code wrote come back with ``collect``, byte-exact; 64 MiB go up into a session
and 64 MiB come back, in chunks, while another session's steps keep running.

One router, one worker, one pool for the module.
"""

from __future__ import annotations

import hashlib
import threading

import pytest
from readie.testing import local_router, temp_pool

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

MiB = 1024 * 1024
BIG = 64 * MiB


@pytest.fixture(scope="module")
def routed():
    with local_router(workers=1, checkpoints=CHECKPOINTS, warm="pandas=1", slots=3) as cluster:
        with temp_pool(workers=3, router=cluster.address, preload=["pandas", "numpy"], checkpoints=CHECKPOINTS) as pool:
            yield pool


def test_a_csv_in_and_a_png_and_an_xlsx_out(routed):
    code = (
        "import hashlib, os, struct, zipfile, zlib\n"
        "import pandas as pd\n"
        "orders = pd.read_csv('data/orders.csv')\n"
        "totals = orders.groupby('product').amount.sum()\n"
        "def chunk(kind, data):\n"
        "    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))\n"
        "rows = b''.join(b'\\x00' + bytes([min(255, 40 * int(v)), 0, 0]) for v in totals)\n"
        "png = (b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', 1, len(totals), 8, 2, 0, 0, 0))\n"
        "       + chunk(b'IDAT', zlib.compress(rows)) + chunk(b'IEND', b''))\n"
        "os.makedirs('out', exist_ok=True)\n"
        "open('out/chart.png', 'wb').write(png)\n"
        "with zipfile.ZipFile('report.xlsx', 'w') as book:\n"
        "    book.writestr('[Content_Types].xml', '<Types/>')\n"
        "    book.writestr('xl/worksheets/sheet1.xml', totals.to_csv())\n"
        "for name in ('out/chart.png', 'report.xlsx'):\n"
        "    print(name, hashlib.sha256(open(name, 'rb').read()).hexdigest())\n"
        "print(totals.to_dict())\n"
    )
    result = routed.run(code, files={"data/orders.csv": b"product,amount\ntea,3\ncake,5\ntea,4\n"},
                        collect=["out/*.png", "*.xlsx"]).raise_for_error()
    *hashes, totals = result.stdout.splitlines()
    assert totals == "{'cake': 5, 'tea': 7}"
    assert sorted(result.collected) == ["out/chart.png", "report.xlsx"] and not result.left_out
    assert {name: hashlib.sha256(data).hexdigest() for name, data in result.collected.items()} == dict(
        line.split() for line in hashes)
    assert result.collected["out/chart.png"].startswith(b"\x89PNG") and result.collected["report.xlsx"][:2] == b"PK"


def test_64_mib_up_and_down_while_another_session_steps(routed, tmp_path):
    local = tmp_path / "in.bin"
    with local.open("wb") as file:  # written a MiB at a time: the upload reads it so too
        for n in range(BIG // MiB):
            file.write(hashlib.shake_256(n.to_bytes(4, "big")).digest(MiB))
    expected = hashlib.sha256(local.read_bytes()).hexdigest()
    stepping = threading.Event()
    steps: list[str] = []

    def keep_stepping() -> None:
        with routed.session() as other:
            other.run("n = 0")
            stepping.set()
            while stepping.is_set():
                steps.append(other.run("n += 1\nprint(n)").stdout)

    stepper = threading.Thread(target=keep_stepping)
    stepper.start()
    try:
        assert stepping.wait(60)
        with routed.session(memory="1g") as nb:
            assert nb.upload("in/data.bin", local) == BIG
            step = nb.run(
                "import hashlib\n"
                "data = open('in/data.bin', 'rb').read()\n"
                "print(hashlib.sha256(data).hexdigest())\n"
                "open('out.bin', 'wb').write(data[::-1])\n"
                "del data\n"
            ).raise_for_error()
            assert step.stdout == f"{expected}\n"
            back = nb.download("out.bin", to=tmp_path / "out.bin")
    finally:
        stepping.clear()
        stepper.join(60)
    assert back.stat().st_size == BIG and hashlib.sha256(back.read_bytes()[::-1]).hexdigest() == expected
    assert len(steps) >= 3 and steps == [f"{n}\n" for n in range(1, len(steps) + 1)]
