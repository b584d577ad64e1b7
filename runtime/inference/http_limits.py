"""Limits of the inference server at the connection level, where the app cannot see: a cap on open connections and
a deadline for a request's headers (the body's deadline is the app's: runtime.inference.server).

uvicorn's own protocol holds a connection that never finishes its headers for as long as the client likes (its
keep-alive timeout starts only after a response), so a few hundred slow clients hold the server's sockets. This is
uvicorn's h11 protocol with two additions:
  - a connection beyond `max_connections` open ones is answered 503 and closed at once;
  - a connection whose request headers are not complete `header_timeout_s` after its first byte (or after it
    opened) is answered 408 and closed.
Each prints one line on stderr.
"""

from __future__ import annotations

import sys

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
TOO_SLOW = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def log(message: str) -> None:
    print(f"zplan: {message}", file=sys.stderr, flush=True)


def peer(transport) -> str:
    address = transport.get_extra_info("peername")
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) and len(address) >= 2 else "a client"


def limited_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the connection cap and the header deadline (uvicorn.Config(http=...))."""

    class LimitedH11Protocol(H11Protocol):
        refused = False
        header_timer = None

        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                self.refused, self.transport = True, transport
                log(f"refused a connection from {peer(transport)}: {max_connections} connections are open")
                transport.write(BUSY)
                transport.close()
                return
            super().connection_made(transport)
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_headers()

        def connection_lost(self, exc) -> None:
            if self.refused:
                return
            self._stop_header_timer()
            super().connection_lost(exc)

        def _watch_headers(self) -> None:
            """A deadline while a request's headers are awaited (h11 state IDLE after data), none once they came."""
            if self.conn.their_state is not h11.IDLE:
                self._stop_header_timer()
            elif self.header_timer is None and not self.transport.is_closing():
                self.header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _stop_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_too_slow(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log(f"closed the connection from {peer(self.transport)}: no complete request headers within "
                    f"{header_timeout_s:g} s")
                self.transport.write(TOO_SLOW)
                self.transport.close()

    return LimitedH11Protocol
