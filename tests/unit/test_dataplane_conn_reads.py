"""The receive path's reads (``conn.py``): small reads go through the scratch buffer, whose one
``recv`` takes what follows them too, and large ones straight into the reader's view; either
way each read gets exactly the stream's next bytes, whatever the split."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from kvgov.proxy.dataplane.conn import DIRECT_BYTES, SCRATCH_BYTES, StreamProtocol


class _Reader(StreamProtocol):
    """Reads a 16-byte head, ``meta`` bytes with ``read_exact``, then views of ``sizes``."""

    def __init__(self, meta: int, sizes: list[int]) -> None:
        super().__init__()
        self.meta = meta
        self.sizes = sizes
        self.got: list[bytes] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def handle(self) -> None:
        try:
            head = memoryview(bytearray(16))
            await self.read_into(head)
            self.got.append(bytes(head))
            self.got.append(await self.read_exact(self.meta))
            for size in self.sizes:
                view = memoryview(bytearray(size))
                await self.read_into(view)
                self.got.append(bytes(view))
            self.done.set_result(None)
        except BaseException as exc:
            self.done.set_exception(exc)
            raise


@pytest.mark.parametrize(
    "sizes",
    [
        [100],  # a small value: it arrived with the header
        [DIRECT_BYTES - 1, DIRECT_BYTES, DIRECT_BYTES + 1],  # around the direct-read bound
        [3 * SCRATCH_BYTES + 7, 5, 2 << 20],  # large views, a small one between them
    ],
)
async def test_each_read_gets_the_streams_next_bytes(sizes: list[int]) -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    reader = _Reader(300, sizes)
    transport, _ = await loop.create_connection(lambda: reader, sock=ours)
    parts = [os.urandom(n) for n in (16, 300, *sizes)]
    theirs.setblocking(False)
    try:
        await loop.sock_sendall(theirs, b"".join(parts))  # all at once: splits are the kernel's
        await asyncio.wait_for(asyncio.shield(reader.done), 10)
        assert reader.got == parts
    finally:
        transport.close()
        theirs.close()
