"""A TCP proxy in front of a real server that, when armed, forwards the next request and drops the
connection instead of its reply: the client's command ran, its answer was lost (what a network
blip or a killed proxy does). Used by the store's retry and durability tests."""

from __future__ import annotations

import asyncio


class ReplyDropper:
    def __init__(self, port: int):
        self.port = port
        self.armed = False
        self.dropped = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _pipe(self, reader, writer, from_server: bool) -> None:
        try:
            while data := await reader.read(65536):
                if from_server and self.armed:
                    self.armed = False
                    self.dropped += 1
                    break  # the reply never reaches the client
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _handle(self, client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.port)
        await asyncio.gather(self._pipe(client_reader, server_writer, False),
                             self._pipe(server_reader, client_writer, True))
