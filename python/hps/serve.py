"""`hps serve PATH`: an hps.Lookup over a small local HTTP interface (docs/serving.md).

The server is the standard library's ThreadingHTTPServer: nothing to install on
any Python (a fresh Debian 12's included), maintained with CPython, and enough
for a local sidecar, since the lookups themselves release the GIL in SSD-PS.
A thread per connection, at most ``max_connections`` of them (one more has its
request answered 503 and is closed: at most as many again at once, each given
REFUSED_REQUEST_TIMEOUT; past that one is closed as it is accepted), each request
given ``request_timeout`` from its first byte, each answer ``request_timeout`` from
its first byte written (a client that does not take it is closed), and at most
``max_concurrent`` lookups at once, each from its keys parsed to its answer encoded:
one more is answered 429 at once rather than queued without bound.

    POST /lookup   keys in; rows and found out. Content-Type:
                   application/json: {"keys": [int, ...]} -> {"rows": [[float] * dim, ...],
                     "found": [bool, ...], "checkpoint": N, "step": S, "run": R, "nonfinite": [int, ...]}
                     (a NaN or infinity in a row, which JSON cannot hold, is null, and
                     "nonfinite" lists the indices of the rows that held one)
                   application/octet-stream: little-endian uint64 keys -> n * dim float32
                     rows (little-endian), then n bytes of found (0/1); headers
                     X-Hps-Dim, X-Hps-Checkpoint, X-Hps-Step, X-Hps-Run (the last two
                     absent where the job records none)
    POST /refresh  moves to the job's newer checkpoint: {"moved": bool, "checkpoint": N, "run": R}
    GET  /health   {"run", "checkpoint", "step", "world", "dim"} (HEAD: its headers)
    GET  /stats    Lookup.stats(), and the server's: rejected (429s), max_concurrent, connections
                   (open now), max_connections, refused_connections (503s for that limit),
                   unsent_answers (connections closed with an answer their client did not
                   take within the request timeout)
Errors are JSON {"error": "..."}, http.server's own too (send_error): 400 malformed (naming the field or key index),
404 unknown path, 405 wrong method (with Allow), 408 a body not all sent within the idle
timeout (60 s; a connection idle that long is closed) or the request timeout (30 s), 411
no Content-Length, 413 too many keys or bytes, 415 other content types, 429 over the concurrency limit, 500 a failure of
the lookup or the refresh (logged to stderr; a failed refresh keeps the checkpoint),
503 a request while the server stops (server_close waits for those using the lookup)
or on a connection past max_connections (with Retry-After).
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

import numpy as np

from hps.lookup import Lookup

MAX_KEYS = 1 << 20          # keys in one request
MAX_BODY = 64 << 20         # bytes of one request body (JSON keys take up to ~21 bytes each)
REFUSED_REQUEST_TIMEOUT = 1.0  # seconds a connection past max_connections has to send its request


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def _too_long(digits: int) -> HttpError:
    return HttpError(400, f"body: an integer of {digits} digits; keys are integers in [0, 2^64 - 2]")


def _keys_from_json(body: bytes) -> np.ndarray:
    try:
        doc = json.loads(body)  # no parse_int hook: a Python call a key tripled the parse
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HttpError(400, f"body: not JSON ({e})") from None
    except RecursionError:  # arrays nested thousands deep
        raise HttpError(400, "body: not JSON (nested too deeply)") from None
    except ValueError:  # past 4300 digits int() refuses an integer (CPython 3.11+): name its length
        raise _too_long(max(len(run) for run in re.findall(rb"[0-9]+", body))) from None
    if not isinstance(doc, dict) or "keys" not in doc:
        raise HttpError(400, 'body: a JSON object with a "keys" array expected')
    keys = doc["keys"]
    if not isinstance(keys, list):
        raise HttpError(400, f'"keys": an array expected, not {type(keys).__name__}')
    if len(keys) > MAX_KEYS:
        raise HttpError(413, f'"keys": {len(keys)} keys, more than the {MAX_KEYS} a request may hold')
    for i, k in enumerate(keys):
        if type(k) is not int or not 0 <= k < (1 << 64) - 1:
            if type(k) is int and len(str(abs(k))) > 20:  # a key has at most 20 digits
                raise _too_long(len(str(abs(k))))
            raise HttpError(400, f'"keys"[{i}] = {json.dumps(k)}: keys are integers in [0, 2^64 - 2]')
    return np.array(keys, np.uint64)


def _keys_from_bytes(body: bytes) -> np.ndarray:
    if len(body) % 8:
        raise HttpError(400, f"body: {len(body)} bytes, not a whole number of 8-byte little-endian uint64 keys")
    keys = np.frombuffer(body, "<u8").astype(np.uint64)
    if len(keys) > MAX_KEYS:
        raise HttpError(413, f"body: {len(keys)} keys, more than the {MAX_KEYS} a request may hold")
    bad = np.flatnonzero(keys == np.uint64((1 << 64) - 1))
    if len(bad):
        raise HttpError(400, f"key at index {int(bad[0])}: 2^64 - 1 is reserved (hps.EMPTY_KEY)")
    return keys


# A name's address that this host cannot listen on: IPv6 disabled (::1 still in /etc/hosts
# for localhost), or an address of another host. Skipped while another address serves.
_UNAVAILABLE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def _format_address(sockaddr) -> str:
    host, port = sockaddr[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind(family: int, sockaddr, v6only: bool, backlog: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server's: a restart reuses the port
        if v6only:  # "::" beside "0.0.0.0" (host ""): a dual-stack "::" would take IPv4's port too
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _bind_all(addresses: list, backlog: int) -> tuple[list[socket.socket], list[str]]:
    several = len(addresses) > 1
    socks: list[socket.socket] = []
    skipped: list[tuple[str, OSError]] = []
    try:
        for family, sockaddr in addresses:
            if socks:  # port 0: the port the first address was given
                sockaddr = (sockaddr[0], socks[0].getsockname()[1], *sockaddr[2:])
            try:
                socks.append(_bind(family, sockaddr, family == socket.AF_INET6 and several, backlog))
            except OSError as e:
                if e.errno not in _UNAVAILABLE:
                    raise OSError(e.errno, f"{_format_address(sockaddr)}: {e.strerror}" if several
                                  else e.strerror) from None
                skipped.append((sockaddr[0], e))  # its port is not why
        if not socks:  # none of the addresses is this host's: the first one's reason
            where, e = skipped[0]
            raise OSError(e.errno, f"{where}: {e.strerror}" if several else e.strerror)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks, [f"{where}: {e.strerror}" for where, e in skipped]


def _listen(host: str, port: int, backlog: int) -> tuple[list[socket.socket], list[str]]:
    """Listening sockets on every address host resolves to, in getaddrinfo's order (the
    system's preference), and the addresses skipped as unavailable, each "ADDRESS: why".

    A name is listened on at each of its addresses, not one: a client on this host may
    try any of them first (glibc's order, curl's, put ::1 first for localhost, Java's
    127.0.0.1), and one that finds nothing there fails unless it falls back to the next.
    With port 0 every address gets the port the first was given; should another process
    hold that port on a later address, the whole set is tried again on a new port."""
    found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = []
    for family, _, _, _, sockaddr in found:
        if family in (socket.AF_INET, socket.AF_INET6) and (family, sockaddr) not in addresses:
            addresses.append((family, sockaddr))
    attempt = 1
    while True:
        try:
            return _bind_all(addresses, backlog)
        except OSError as e:
            if not (port == 0 and len(addresses) > 1 and e.errno == errno.EADDRINUSE and attempt < 8):
                raise
            attempt += 1


def _rows_json(rows: np.ndarray) -> tuple[list, list]:
    """(rows as lists of floats, the indices of the rows that hold a NaN or an
    infinity). JSON has no NaN or infinity: each such value is written null, as
    JavaScript's JSON.stringify does (np.array(..., np.float32) reads null back as
    NaN), and the rows that held one are listed, so that a client can tell a row of
    a diverged model from a sound one without scanning for nulls."""
    out = rows.tolist()
    bad = ~np.isfinite(rows)
    if not bad.any():  # the usual answer: one vectorised check
        return out, []
    for i, j in zip(*np.nonzero(bad)):
        out[i][j] = None
    return out, np.flatnonzero(bad.any(axis=1)).tolist()


def _json_bytes(obj) -> bytes:
    # allow_nan=False: json would write bare NaN / Infinity, which is not JSON and
    # which strict parsers refuse; rows are made finite first (_rows_json), and a
    # non-finite number anywhere else is a bug, answered 500 by _handle.
    return json.dumps(obj, allow_nan=False).encode()


def _serving(lookup: Lookup) -> str:
    """What a failed refresh left served, for its message."""
    try:
        return f"still serving checkpoint {lookup.checkpoint}"
    except RuntimeError:  # it could open neither checkpoint (Lookup.refresh): the next refresh tries again
        return "serving no checkpoint until a refresh succeeds"


class _Connections:
    """The accepting loop's part of LookupServer and of its _Listeners: each connection
    is counted against the owner's max_connections before a thread is started for it,
    and one past both limits gets no thread."""

    owner: "LookupServer"

    def process_request(self, request, client_address) -> None:
        admitted = self.owner.connection_opened()
        if admitted is None:
            _refuse_unread(request, self.owner.over_limit_error())
            self.shutdown_request(request)
            return
        try:
            threading.Thread(target=self._connection, args=(request, client_address, admitted), daemon=True,
                             name="hps-serve-connection").start()
        except BaseException:  # no thread (the system's limit): socketserver closes the connection
            self.owner.connection_closed(admitted)
            raise

    def _connection(self, request, client_address, admitted: bool) -> None:
        try:
            _Handler(request, client_address, self.owner, admitted)
        except Exception:  # noqa: BLE001 - as socketserver's own threads: reported, the server goes on
            self.handle_error(request, client_address)
        finally:
            self.owner.connection_closed(admitted)
            self.shutdown_request(request)


def _refuse_unread(sock: socket.socket, error: HttpError) -> None:
    """Writes error's answer if the socket's buffer takes it at once; the request is not read."""
    body = _json_bytes({"error": str(error)})
    head = (f"HTTP/1.1 {error.status} {BaseHTTPRequestHandler.responses[error.status][0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in error.headers.items()) + "\r\n")
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(head.encode() + body)


class LookupServer(_Connections, ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, lookup: Lookup, address=("127.0.0.1", 0), max_concurrent: int = 8,
                 refresh_every: float = 0.0, quiet: bool = True, idle_timeout: float = 60.0,
                 max_connections: int = 64, request_timeout: float = 30.0):
        # (inf, or anything past TIMEOUT_MAX, was taken, and then each connection's
        # settimeout raised OverflowError: every request dropped unanswered, with a traceback)
        if not 0 < idle_timeout <= threading.TIMEOUT_MAX:
            raise ValueError(f"idle_timeout = {idle_timeout}: must be a number of seconds above 0, at most "
                             f"{threading.TIMEOUT_MAX:.0f}")
        if not 0 < request_timeout <= threading.TIMEOUT_MAX:
            raise ValueError(f"request_timeout = {request_timeout}: must be a number of seconds above 0, at most "
                             f"{threading.TIMEOUT_MAX:.0f}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent = {max_concurrent}: must be >= 1")
        if max_connections < 1:
            raise ValueError(f"max_connections = {max_connections}: must be >= 1")
        # (NaN passed a test of < 0, and then the refresher's wait returned at once: a
        # refresh in a loop with no pause; past TIMEOUT_MAX the wait raised, killing it)
        if not 0 <= refresh_every <= threading.TIMEOUT_MAX:
            raise ValueError(f"refresh_every = {refresh_every}: must be a number of seconds from 0 to "
                             f"{threading.TIMEOUT_MAX:.0f}")
        self.lookup = lookup
        self.slots = threading.BoundedSemaphore(max_concurrent)
        self.max_concurrent = max_concurrent
        self.quiet = quiet
        self.rejected = 0
        self._rejected_lock = threading.Lock()  # += from the handlers' threads
        # Connections open now, each with its thread (a kept-alive one idle up to
        # idle_timeout): one past max_connections has its request answered 503 and is
        # closed, so that clients' idle pools cannot pile up threads without bound. The
        # refused ones have threads too, for at most REFUSED_REQUEST_TIMEOUT each, and at
        # most max_connections of them at once: one more is closed by the accepting loop
        # itself (a 503 written if the socket takes it, its request unread), so that
        # connections that send nothing cannot pile up threads either.
        self.max_connections = max_connections
        self.connections = 0
        self.refused_connections = 0
        self._refusing = 0
        self._connections_lock = threading.Lock()
        # A connection that sends nothing for this long is closed: a client that stalls
        # mid-request (a Content-Length it never fills) would hold its thread for good.
        self.idle_timeout = idle_timeout
        # A request's line, headers and body must all arrive within this long of its first
        # byte (a new connection's first request: of connecting): one sent a byte at a time,
        # each within idle_timeout of the last, held its thread, and its connection's place
        # under max_connections, for as long as its client liked (slowloris).
        self.request_timeout = request_timeout
        # Answers not all taken by their client within request_timeout of their first byte
        # (_DeadlineWriter), their connections closed: a client that sends a lookup and
        # reads its answer slowly, or not at all, held its thread, and its place under
        # max_connections, for idle_timeout per write of the answer (slow read).
        self.unsent_answers = 0
        self._stop = threading.Event()
        # Requests using the lookup now (its native reads under way): server_close waits
        # for them, so that the lookup is closed, and the process exits, with none in a
        # read. (A daemon thread still in a read when the interpreter exited aborted the
        # process, SIGABRT from the C++ runtime, and left the checkpoint pinned.)
        self._using = 0
        self._unused = threading.Condition()
        socks, self.unavailable = _listen(address[0], address[1], self.request_queue_size)
        self.address_family = socks[0].family  # the class's is IPv4's
        super().__init__(socks[0].getsockname(), _Handler, bind_and_activate=False)
        self.socket.close()  # the unbound one the base class made
        self.socket = socks[0]
        self.server_name, self.server_port = self.server_address[:2]
        # the name's other addresses: their connections are served as this server's own
        self._listeners = [_Listener(self, sock) for sock in socks[1:]]
        self._refresher: Optional[threading.Thread] = None
        if refresh_every:
            self._refresher = threading.Thread(target=self._refresh_loop, args=(refresh_every,), daemon=True,
                                               name="hps-serve-refresh")
            self._refresher.start()

    def _refresh_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                # counted as a request using the lookup, so that server_close waits for it: the
                # process exiting with this thread in a refresh's native reads aborted, as with
                # a lookup's (serve's note on os._exit)
                with self.using_lookup() as lookup:
                    lookup.refresh()
            except HttpError:
                break  # the server is stopping
            except Exception as e:  # noqa: BLE001 - keep serving the checkpoint it has
                if self._stop.is_set():
                    break  # the server stopped and closed the lookup meanwhile
                print(f"hps serve: refresh failed, {_serving(self.lookup)}: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def using_lookup(self):
        """Around a handler's use of the lookup: refused with 503 once the server is
        closing, and waited for by server_close."""
        with self._unused:
            if self._stop.is_set():
                raise HttpError(503, "the server is stopping")
            self._using += 1
        try:
            yield self.lookup
        finally:
            with self._unused:
                self._using -= 1
                self._unused.notify_all()

    @property
    def owner(self) -> "LookupServer":
        return self  # the server whose connections _Connections.process_request counts

    def connection_opened(self) -> Optional[bool]:
        """Counts a new connection in: True if served, False if past max_connections (its
        request to be answered 503), None if as many are being refused already (to be
        closed at once)."""
        with self._connections_lock:
            if self.connections < self.max_connections:
                self.connections += 1
                return True
            self.refused_connections += 1
            if self._refusing < self.max_connections:
                self._refusing += 1
                return False
            return None

    def connection_closed(self, admitted: bool) -> None:
        with self._connections_lock:
            if admitted:
                self.connections -= 1
            else:
                self._refusing -= 1

    def over_limit_error(self) -> HttpError:
        return HttpError(503, f"{self.max_connections} connections open, the server's limit: retry, or reuse a "
                              f"connection kept alive", {"Retry-After": 1})

    def count_rejected(self) -> None:
        with self._rejected_lock:
            self.rejected += 1

    def count_unsent_answer(self) -> None:
        with self._rejected_lock:
            self.unsent_answers += 1

    @property
    def url(self) -> str:
        """The first address's URL (the system's preferred address of the host)."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """A URL for each address listened on, in getaddrinfo's order."""
        return [f"http://{_format_address(sock.getsockname())}"
                for sock in [self.socket, *(lst.socket for lst in self._listeners)]]

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        for lst in self._listeners:
            threading.Thread(target=lst.serve_forever, args=(poll_interval,), daemon=True,
                             name="hps-serve-listen").start()
        try:
            super().serve_forever(poll_interval)
        finally:  # stopped when this returns, so that server_close next does not close them under their loops
            for lst in self._listeners:
                lst.shutdown()

    def shutdown(self) -> None:
        super().shutdown()  # returns once the first address's loop is done, before the others'
        for lst in self._listeners:
            lst.shutdown()

    def server_close(self, give_up: Optional[threading.Event] = None) -> None:
        """Stops listening, then waits for the requests using the lookup to return
        from it (one batch each): the caller may close the lookup next. Once give_up
        is set the wait ends, the requests still under way left counted in
        requests_using_lookup."""
        with self._unused:
            self._stop.set()
        for lst in self._listeners:
            lst.server_close()
        super().server_close()
        with self._unused:
            while self._using and not (give_up is not None and give_up.is_set()):
                self._unused.wait(None if give_up is None else 0.05)

    @property
    def requests_using_lookup(self) -> int:
        """Requests in the lookup now (in its native reads, or a refresh's)."""
        with self._unused:
            return self._using


class _Listener(_Connections, socketserver.TCPServer):
    """Another address of a LookupServer's host, on its own listening socket: each
    connection is handled as one of the LookupServer's (its lookup, limits, counters)."""
    daemon_threads = True

    def __init__(self, owner: LookupServer, sock: socket.socket):
        self.address_family = sock.family
        super().__init__(sock.getsockname(), _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.owner = owner


def _wait_for(handler: "_Handler", deadline: Optional[float]) -> tuple[float, float]:
    """How long a connection's next read or send may wait: the idle timeout, or what
    is left to `deadline` (of time.monotonic(); None: no deadline) where that is less;
    and the bound that wait enforces, for the timeout's message."""
    idle = handler.server.idle_timeout
    if deadline is not None:
        left = deadline - time.monotonic()
        if left < idle:
            return left, handler.request_timeout
    return idle, idle


class _DeadlineReader(io.RawIOBase):
    """A connection's reads, each given at most the idle timeout and at most the time
    left to the request read now (handler.deadline, of time.monotonic(); None between
    requests). A timeout raises TimeoutError naming the bound that was hit."""

    def __init__(self, sock: socket.socket, handler: "_Handler"):
        super().__init__()
        self._sock = sock
        self._handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        idle = self._handler.server.idle_timeout
        timeout, bound = _wait_for(self._handler, self._handler.deadline)
        if timeout <= 0:
            raise TimeoutError(f"not all sent within {bound:g} s")
        self._sock.settimeout(timeout)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            raise TimeoutError(f"not all sent within {bound:g} s") from None
        finally:
            self._sock.settimeout(idle)  # the base class's, should anything but these two use the socket


class _AnswerTimeout(TimeoutError):
    """An answer its client did not take in time: the connection is closed unanswered."""


class _DeadlineWriter(io.BufferedIOBase):
    """A connection's writes. An answer (handler.answer_deadline, of time.monotonic(), set
    by _Handler._send as it starts writing one; None outside) must be taken whole by its
    client within the handler's request_timeout of its first byte, and each send waits at
    most the idle timeout for the client to take more: past either, the answer is counted
    in the server's unsent_answers and _AnswerTimeout raised. The answer has a deadline
    of its own, not what is left of its request's: the lookup's time is the server's, and
    a request read near its deadline would leave its answer next to none."""

    def __init__(self, sock: socket.socket, handler: "_Handler"):
        super().__init__()
        self._sock = sock
        self._handler = handler

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        idle = self._handler.server.idle_timeout
        view = memoryview(data).cast("B")
        try:
            while view:
                timeout, bound = _wait_for(self._handler, self._handler.answer_deadline)
                if timeout <= 0:
                    raise self._timed_out(bound)
                # send, not sendall: sendall's timeout bounds the whole call, which would cut
                # an answer its client takes steadily for longer than idle (a request_timeout
                # above idle_timeout), and let one taken a byte at a time keep idle per write
                self._sock.settimeout(timeout)
                try:
                    sent = self._sock.send(view)
                except TimeoutError:
                    raise self._timed_out(bound) from None
                view = view[sent:]
        finally:
            self._sock.settimeout(idle)
        return len(data)

    def _timed_out(self, bound: float) -> _AnswerTimeout:
        self._handler.server.count_unsent_answer()
        return _AnswerTimeout(f"the answer not all taken by the client within {bound:g} s")


class _Handler(BaseHTTPRequestHandler):
    server: LookupServer
    protocol_version = "HTTP/1.1"

    def __init__(self, request, client_address, server, admitted: bool = True):
        self._over_limit = not admitted
        self._accepted = time.monotonic()
        # a refused connection is not waited for beyond a short bound: it holds a thread
        self.request_timeout = (server.request_timeout if admitted else
                                min(server.request_timeout, REFUSED_REQUEST_TIMEOUT))
        self.deadline: Optional[float] = None
        self.answer_deadline: Optional[float] = None
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout  # the socket's, set by the base class's setup
        super().setup()
        self.rfile.close()  # the base class's, without the request's deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self))
        self.wfile.close()  # the base class's, without the answer's deadline
        self.wfile = _DeadlineWriter(self.connection, self)

    def handle(self) -> None:
        """The base class's loop of requests, each given request_timeout from its first
        byte (the first request: from connecting); between them the connection may be
        idle for idle_timeout."""
        self.deadline = self._accepted + self.request_timeout
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection:
            self.deadline = None
            try:
                if not self.rfile.peek(1):
                    break  # the client closed it
            except OSError:  # TimeoutError (idle_timeout) included
                break
            self.deadline = time.monotonic() + self.request_timeout
            self.handle_one_request()

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        if not self.server.quiet:
            super().log_message(format, *args)

    def _send(self, status: int, body: bytes, content_type: str = "application/json", headers=None) -> None:
        self._answered = True
        self.answer_deadline = time.monotonic() + self.request_timeout
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.end_headers()
            if self.command != "HEAD":  # HEAD: GET's headers, no body
                self.wfile.write(body)
        except _AnswerTimeout:
            self.close_connection = True  # the answer is cut short: the connection cannot carry another
            raise
        finally:
            self.answer_deadline = None

    def _json(self, status: int, obj, headers=None) -> None:
        self._send(status, _json_bytes(obj), headers=headers)

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """http.server's own refusals, made before a request reaches _handle (a malformed
        request line, an unsupported HTTP version, a line or header block over its
        limits, a method with no do_ handler): JSON like every other answer, not the
        base class's HTML page. The request was not read whole: the connection closes."""
        self.close_connection = True
        text = message or self.responses.get(code, ("error",))[0]
        self.log_error("code %d, message %s", code, text)
        if self.request_version == "HTTP/0.9":  # the default when the request line was not understood:
            self.request_version = "HTTP/1.0"  # the answer still gets a status line and headers
        try:
            self._json(code, {"error": f"{text}: {explain}" if explain else text})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left

    def _body(self, required: bool = True, keep: bool = True) -> bytes:
        """The request's body (b"" if not keep: read and dropped, a piece at a time). Without
        Content-Length or Transfer-Encoding a request has none (RFC 9112 6.3): only
        /lookup, whose keys are its body, refuses that. Chunked bodies are not read: 411
        (left unread, they would be taken for a request)."""
        lengths = self.headers.get_all("Content-Length", [])
        if len(set(lengths)) > 1:  # which one frames the body is unknowable (RFC 9112 6.3)
            raise HttpError(400, f"Content-Length given {len(lengths)} times, differing: {', '.join(lengths)}")
        length = lengths[0] if lengths else None
        if "Transfer-Encoding" in self.headers:  # it frames the body, Content-Length or not (RFC 9112 6.3)
            raise HttpError(411, f"Transfer-Encoding {self.headers['Transfer-Encoding']!r}: not read; send "
                                 f"the body with a Content-Length")
        if length is None:
            if not required:
                return b""
            raise HttpError(411, "Content-Length required")
        # digits alone (RFC 9110 8.6): int() also takes "+13", "1_3" and other scripts'
        # digits, read as a length where a proxy in front may read none or another
        if re.fullmatch(r"-[0-9]+", length):
            raise HttpError(400, f"Content-Length {length}: negative")
        if not re.fullmatch(r"[0-9]+", length):
            raise HttpError(400, f"Content-Length {length!r}: not a number")
        n = int(length)
        if n > MAX_BODY:
            raise HttpError(413, f"body of {n} bytes, more than {MAX_BODY}")
        try:
            if keep:
                body = self.rfile.read(n)
                got = len(body)
            else:
                body, got = b"", 0
                while got < n and (piece := self.rfile.read(min(n - got, 1 << 16))):
                    got += len(piece)
        except TimeoutError as e:
            raise HttpError(408, f"body: {n} bytes declared, {e}") from None
        if got != n:  # the client closed its side early: a short body is not the request
            raise HttpError(400, f"body: {n} bytes declared, {got} sent before the client closed")
        return body

    def _handle(self, method: str) -> None:
        routes = {"/lookup": "POST", "/refresh": "POST", "/health": "GET", "/stats": "GET"}
        path = self.path.split("?", 1)[0]
        self._answered = False
        try:
            if self._over_limit:  # its request read first, as any refused one's (below), and dropped
                with contextlib.suppress(HttpError):  # framing or time out: answered 503 all the same
                    self._body(required=False, keep=False)
                raise self.server.over_limit_error()
            # A refused request's body is read first (any method's: Content-Length frames them
            # all): a connection closed with bytes unread is reset, and the answer may be lost.
            if path not in routes:
                self._body(required=False)
                raise HttpError(404, f"{path}: no such endpoint (POST /lookup, POST /refresh, GET /health, "
                                     f"GET /stats)")
            if routes[path] != method and (method, routes[path]) != ("HEAD", "GET"):
                self._body(required=False)
                # RFC 9110 15.5.6: a 405 names the methods the resource takes, so that a
                # client can correct itself without reading the error text
                allow = "GET, HEAD" if routes[path] == "GET" else routes[path]
                raise HttpError(405, f"{method} {path}: use {routes[path]}", {"Allow": allow})
            if path == "/lookup":
                self._lookup()
            elif path == "/refresh":
                self._body(required=False)
                with self.server.using_lookup() as lookup:
                    try:
                        moved = lookup.refresh()
                    except Exception as e:  # noqa: BLE001 - the checkpoint served stays, as with --refresh-every
                        raise HttpError(500, f"refresh failed, {_serving(lookup)}: "
                                             f"{type(e).__name__}: {e}") from None
                    served = lookup.served()
                    answer = {"moved": moved, "checkpoint": served["checkpoint"], "run": served["run"]}
                self._json(200, answer)
            elif path == "/health":
                with self.server.using_lookup() as lookup:
                    answer = lookup.served()  # one checkpoint's, whatever a refresh does meanwhile
                self._json(200, answer)
            else:
                with self.server.using_lookup() as lookup:
                    answer = {**lookup.stats(), "rejected": self.server.rejected,
                              "max_concurrent": self.server.max_concurrent,
                              "connections": self.server.connections,
                              "max_connections": self.server.max_connections,
                              "refused_connections": self.server.refused_connections,
                              "unsent_answers": self.server.unsent_answers}
                self._json(200, answer)
        except HttpError as e:
            self.close_connection = True  # the body may be unread: the connection cannot carry another request
            if e.status >= 500:
                print(f"hps serve: {self.command} {path}: {e}", file=sys.stderr, flush=True)
            self._json(e.status, {"error": str(e)}, e.headers)
        except (BrokenPipeError, ConnectionResetError, _AnswerTimeout):
            self.close_connection = True  # the client left, or does not take its answer: no one to answer
        except Exception as e:  # noqa: BLE001 - answered, not a dropped connection with a traceback
            self.close_connection = True
            print(f"hps serve: {self.command} {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if not self._answered:
                self._json(500, {"error": f"{type(e).__name__}: {e}"})

    def _lookup(self) -> None:
        kind = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        body = self._body()
        if kind not in ("application/json", "application/octet-stream"):
            raise HttpError(415, f"Content-Type {kind or '(none)'!r}: send application/json or "
                                 f"application/octet-stream")
        # The slot covers the keys parsed and the answer encoded, not the lookup alone: a
        # JSON request's keys as Python ints, and its answer's rows as lists of floats, take
        # many times the body's bytes, so that outside the slot max_concurrent bounded the
        # reads but not the memory (every connection parsing and encoding at once). The
        # body is read before (a slow client would hold a slot), the answer sent after.
        if not self.server.slots.acquire(blocking=False):
            self.server.count_rejected()
            raise HttpError(429, f"{self.server.max_concurrent} lookups under way, the server's limit: retry")
        try:
            keys = _keys_from_json(body) if kind == "application/json" else _keys_from_bytes(body)
            del body
            with self.server.using_lookup() as lookup:
                # the checkpoint the rows were read from: lookup.checkpoint, read after, may be a newer one's
                rows, found, served = lookup.lookup_served(keys)
            del keys
            if kind == "application/json":
                rows_json, nonfinite = _rows_json(rows)
                del rows
                answer = _json_bytes({"rows": rows_json, "found": found.tolist(), "checkpoint": served["checkpoint"],
                                      "step": served["step"], "run": served["run"], "nonfinite": nonfinite})
                del rows_json
                content_type, headers = "application/json", None
            else:
                answer = rows.astype("<f4").tobytes() + found.astype(np.uint8).tobytes()
                content_type = "application/octet-stream"
                headers = {"X-Hps-Dim": rows.shape[1], "X-Hps-Checkpoint": served["checkpoint"]}
                # absent where the job records none (JSON's null)
                for name, field in (("X-Hps-Step", "step"), ("X-Hps-Run", "run")):
                    if served[field] is not None:
                        headers[name] = served[field]
        finally:
            self.server.slots.release()
        self._send(200, answer, content_type, headers)

    def do_GET(self):  # noqa: N802 - the base class's names
        self._handle("GET")

    def do_POST(self):  # noqa: N802
        self._handle("POST")

    def do_PUT(self):  # noqa: N802
        self._handle("PUT")

    def do_DELETE(self):  # noqa: N802
        self._handle("DELETE")

    # Without a do_ method http.server answers 501 with an HTML page: these get a 405 in JSON
    # (HEAD: GET's headers), the methods a client or a probe may well send.
    def do_HEAD(self):  # noqa: N802
        self._handle("HEAD")

    def do_PATCH(self):  # noqa: N802
        self._handle("PATCH")

    def do_OPTIONS(self):  # noqa: N802
        self._handle("OPTIONS")


def serve(path: str, host: str = "127.0.0.1", port: int = 8470, memory_budget="256MiB",
          max_concurrent: int = 8, refresh_every: float = 0.0, quiet: bool = False,
          max_connections: int = 64, request_timeout: float = 30.0) -> None:
    """Serves the job at path until interrupted (SIGINT / SIGTERM)."""
    import signal
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a TCP port, 0-65535 (0: any free one)")
    lookup = Lookup(path, memory_budget=memory_budget)
    try:
        server = LookupServer(lookup, (host, port), max_concurrent, refresh_every, quiet,
                              max_connections=max_connections, request_timeout=request_timeout)
    except OSError as e:  # the address: in use, or not this host's
        lookup.close()
        raise OSError(e.errno, f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None
    except BaseException:
        lookup.close()  # releases the pinned checkpoint, as stopping the server does
        raise
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    skipped = f" (not on {'; '.join(server.unavailable)})" if server.unavailable else ""
    print(f"hps serve: {path} checkpoint {lookup.checkpoint} (step {lookup.step}, {lookup.world} rank(s), "
          f"dim {lookup.dim}) on {' and '.join(server.urls)}{skipped}, at most {max_concurrent} lookups at once "
          f"and {max_connections} connections",
          file=sys.stderr, flush=True)
    # The first Ctrl-C stops serving (KeyboardInterrupt out of serve_forever); from then on a
    # Ctrl-C sets a flag rather than raising: raised at any point of the stop it left it half
    # done (the Lookup's close interrupted while removing its pinned view), or left serve()
    # while lookups were in native reads. (One handler for both, so that no second
    # KeyboardInterrupt can slip in before the flag's handler is installed.)
    stopping, interrupted_again = threading.Event(), threading.Event()

    def on_sigint(signum, frame):
        if stopping.is_set():
            interrupted_again.set()
            return
        stopping.set()
        raise KeyboardInterrupt

    sigint = signal.signal(signal.SIGINT, on_sigint)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        stopping.set()  # SIGTERM's stop, or the KeyboardInterrupt's
        try:
            try:
                server.server_close(give_up=interrupted_again)
            finally:
                # a second Ctrl-C, ending server_close's wait for the lookups under way, still
                # releases the checkpoint (at once if none is left in a read, else as the last
                # one returns; a process that exits first leaves its view to the next pin)
                lookup.close()
            under_way = server.requests_using_lookup
            if under_way:
                # The interpreter's exit with a thread still in a native read aborted the process
                # (SIGABRT, "terminate called without an active exception": the finalizing
                # interpreter ends the thread as its read returns, unwinding C++ frames that
                # cannot be unwound). Exit now, without the interpreter's teardown, as Ctrl-C does.
                print(f"hps serve: interrupted again: exiting with {under_way} request(s) still in the lookup",
                      file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(128 + signal.SIGINT)
        finally:
            signal.signal(signal.SIGINT, sigint)
