"""Source shared by the transport tests' programs that run in interpreters of their own."""

from __future__ import annotations

#: ``echo(stream)``: sends back everything a stream brings, then ends it.
ECHO_HANDLER = """
async def echo(stream):
    async with stream:
        while data := await stream.receive_some():
            await stream.send_all(data)
        await stream.send_eof()
"""
