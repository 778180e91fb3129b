"""The pool's stdin and stdout adapters: one read when asked, writes that complete."""

from __future__ import annotations

import asyncio
import os

import pytest
from readie_pool._stdio import FdReader, FdWriter


def test_reads_only_when_asked_and_ends_with_empty_bytes():
    read_end, write_end = os.pipe()

    async def main():
        reader = FdReader(read_end, chunk=4)
        os.write(write_end, b"abcdefgh")
        first = await reader.read()
        # Nothing else was taken from the pipe: the rest is still there.
        assert os.read(read_end, 2) == b"ef"
        second = await reader.read()
        os.close(write_end)
        return first, second, await reader.read()

    try:
        assert asyncio.run(main()) == (b"abcd", b"gh", b"")
    finally:
        os.close(read_end)


def test_a_cancelled_read_does_not_break_the_loop():
    read_end, write_end = os.pipe()

    async def main():
        reader = FdReader(read_end)
        pending = asyncio.create_task(reader.read())
        await asyncio.sleep(0.05)
        pending.cancel()
        os.write(write_end, b"late")  # the abandoned read takes it
        await asyncio.sleep(0.05)
        return pending.cancelled()

    try:
        assert asyncio.run(main())
    finally:
        os.close(read_end)
        os.close(write_end)


def test_writes_everything_then_raises_once_the_reader_is_gone():
    read_end, write_end = os.pipe()
    data = b"x" * (256 * 1024)  # more than a pipe holds: the write must wait for the reader

    async def main():
        writer = FdWriter(write_end)
        reading = asyncio.create_task(asyncio.to_thread(_read_exactly, read_end, len(data)))
        await writer.write(data)
        assert await reading == data
        os.close(read_end)
        with pytest.raises(BrokenPipeError):
            await writer.write(b"more\n")

    try:
        asyncio.run(main())
    finally:
        os.close(write_end)


def _read_exactly(fd: int, size: int) -> bytes:
    chunks = b""
    while len(chunks) < size:
        chunks += os.read(fd, size - len(chunks))
    return chunks
