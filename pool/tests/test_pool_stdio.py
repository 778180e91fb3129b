"""The pool's stdin and stdout adapters: one read when asked, writes that complete."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading

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


def test_a_read_asked_again_at_once_waits_for_data_without_blocking_the_loop():
    # The pipe stays watched between reads: the selector's report that it was readable, made
    # before the first read took the bytes, can reach the second read. It must not block the loop.
    read_end, write_end = os.pipe()

    async def main():
        reader = FdReader(read_end)
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        os.write(write_end, b"one")
        first = await reader.read()
        threading.Timer(0.5, os.write, (write_end, b"two")).start()
        before = ticks
        second = await reader.read()  # asked again at once
        ticking.cancel()
        return first, second, ticks - before

    try:
        first, second, ticked = asyncio.run(main())
    finally:
        os.close(read_end)
        os.close(write_end)
    assert (first, second) == (b"one", b"two")
    assert ticked >= 10  # the loop ran while the read waited (a blocked loop ticks at most once)


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


def test_a_regular_file_is_read_and_written_too(tmp_path):
    # Not a pipe: no selector takes it (``readie pool < jobs.jsonl > out.jsonl``), a thread does.
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"line\n")

    async def main(fd_in, fd_out):
        reader, writer = FdReader(fd_in), FdWriter(fd_out)
        data = await reader.read()
        await writer.write(data)
        return data, await reader.read()

    fd_in, fd_out = os.open(source, os.O_RDONLY), os.open(target, os.O_WRONLY | os.O_CREAT)
    try:
        assert asyncio.run(main(fd_in, fd_out)) == (b"line\n", b"")
    finally:
        os.close(fd_in)
        os.close(fd_out)
    assert target.read_bytes() == b"line\n"

def test_a_small_line_into_a_full_pipe_waits_for_room_without_blocking_the_loop():
    # A pipe is written from the loop when it has room; a full one is waited for, not written into.
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    filled = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            filled += os.write(write_end, b"x" * 4096)
    os.set_blocking(write_end, True)

    async def main():
        writer = FdWriter(write_end)
        pending = asyncio.create_task(writer.write(b"line\n"))
        await asyncio.sleep(0.05)  # the loop runs: the write waits for room
        assert not pending.done()
        drained = await asyncio.to_thread(_read_exactly, read_end, filled + 5)
        await pending
        return drained[-5:]

    try:
        assert asyncio.run(main()) == b"line\n"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_write_now_writes_a_line_whole_or_not_at_all():
    # From a job's thread (a host call's line): only what cannot block nor split a line in progress.
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    line = b"y" * 100

    async def main():
        writer = FdWriter(write_end)
        assert writer.write_now(b"call\n")
        assert not writer.write_now(b"z" * (select.PIPE_BUF + 1))  # could be split: the loop writes it
        assert os.read(read_end, 100) == b"call\n"
        filled = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                filled += os.write(write_end, b"x" * 4096)
        assert not writer.write_now(b"call\n")  # no room: it would block
        # A line the loop has begun and waits to finish: a thread's line must not land inside it.
        loop_line = asyncio.create_task(writer.write(line))
        await asyncio.sleep(0.05)
        assert not loop_line.done()
        os.read(read_end, 8192)  # room again; the loop is held (join) so its line stays unfinished
        answers = []
        thread = threading.Thread(target=lambda: answers.append(writer.write_now(b"call\n")))
        thread.start()
        thread.join()
        written_meanwhile = answers[0]
        await loop_line
        return filled, written_meanwhile

    try:
        filled, written_meanwhile = asyncio.run(main())
        assert not written_meanwhile
        rest = _read_exactly(read_end, filled - 8192 + len(line))
        assert rest.endswith(line) and b"call" not in rest
    finally:
        os.close(read_end)
        os.close(write_end)


def test_write_now_leaves_a_regular_file_to_the_thread(tmp_path):
    fd = os.open(tmp_path / "out.jsonl", os.O_WRONLY | os.O_CREAT)
    try:
        assert not FdWriter(fd).write_now(b"call\n")
    finally:
        os.close(fd)
