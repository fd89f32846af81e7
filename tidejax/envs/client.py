"""HTTP/JSON client for `tidejax.envs.server`: a remote env and a server chooser.

`RemoteEnv` speaks the env protocol, so the pool (and anything else) drives a remote
env exactly like a local one. `RemoteEnvFactory` hands out remote envs over a list of
server addresses: least-loaded by live sessions, ties broken round-robin, and a server
that refused a connection is skipped for a short cool-down.

Calls block; the pool runs them on its worker threads. Each thread keeps one
keep-alive connection per server (so connections scale with threads, not sessions).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from tidejax.envs.protocol import MalformedObservation, Task, task_from_options

_IDLE_RECONNECT_S = 20.0  # well under the server's keep-alive timeout, so it never races


class RemoteEnvError(Exception):
    """The server answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"server error {status}: {message}")
        self.status = status


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' or 'http://host:port' -> (host, port)."""
    parts = urlsplit(address if "//" in address else f"http://{address}")
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"address must look like http://host:port, got {address!r}")
    return parts.hostname, parts.port


_local = threading.local()


def _connection(addr: tuple[str, int], timeout_s: float) -> http.client.HTTPConnection:
    pool: dict[tuple[str, int], tuple[http.client.HTTPConnection, float]]
    pool = _local.__dict__.setdefault("conns", {})
    conn, last = pool.get(addr, (None, 0.0))
    if conn is None or time.monotonic() - last > _IDLE_RECONNECT_S:
        if conn is not None:
            conn.close()
        conn = http.client.HTTPConnection(addr[0], addr[1], timeout=timeout_s)
    conn.timeout = timeout_s
    if conn.sock is not None:
        conn.sock.settimeout(timeout_s)
    pool[addr] = (conn, time.monotonic())
    return conn


def _drop(addr: tuple[str, int]) -> None:
    conn, _ = _local.__dict__.get("conns", {}).pop(addr, (None, 0.0))
    if conn is not None:
        conn.close()


def request(
    addr: tuple[str, int], method: str, path: str, payload: Any, timeout_s: float
) -> dict[str, Any]:
    """One JSON request; raises TimeoutError, ConnectionError, RemoteEnvError or
    MalformedObservation (the answer was not a JSON object)."""
    body = b"" if payload is None else json.dumps(payload).encode()
    conn = _connection(addr, timeout_s)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    except TimeoutError as e:
        _drop(addr)
        raise TimeoutError(f"{addr[0]}:{addr[1]}{path}: no answer in {timeout_s}s") from e
    except (OSError, http.client.HTTPException) as e:
        _drop(addr)
        raise ConnectionError(f"{addr[0]}:{addr[1]}{path}: {type(e).__name__}: {e}") from e
    if resp.will_close:
        _drop(addr)
    try:
        obj = json.loads(data)
    except ValueError:
        raise MalformedObservation(f"server sent non-JSON ({len(data)} bytes)") from None
    if not isinstance(obj, dict):
        raise MalformedObservation("server sent JSON that is not an object")
    if resp.status >= 400 and obj.get("error") == "malformed_observation":
        # The server checked the env's answer with the same limits a local pool uses.
        raise MalformedObservation(f"server: {obj.get('message', '')}")
    if resp.status >= 400:
        raise RemoteEnvError(resp.status, str(obj.get("message", obj)))
    return obj


class RemoteEnv:
    """An env living on a server; one server session per episode."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        on_close: Callable[[], None] | None = None,
        on_unreachable: Callable[[], None] | None = None,
    ):
        self.address = address
        self._addr = parse_address(address)
        self.timeout_s = timeout_s
        self._session: str | None = None
        self._on_close = on_close
        self._on_unreachable = on_unreachable
        self._closed = False

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            return request(self._addr, "POST", path, payload, self.timeout_s)
        except ConnectionError:
            if self._on_unreachable is not None:
                self._on_unreachable()
            raise

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        task = task_from_options(options)
        if task is None:
            raise ValueError("a remote env needs options={'task': Task}")
        self._release_session()
        resp = self._post("/reset", {"task": task.to_dict(), "seed": seed})
        try:
            self._session = str(resp["session"])
            return resp["obs"], resp["info"]
        except KeyError as e:
            raise MalformedObservation(f"reset answer lacks {e}") from None

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._session is None:
            raise RuntimeError("call reset() before step()")
        resp = self._post("/step", {"session": self._session, "action": action})
        try:
            return (
                resp["obs"],
                resp["reward"],
                resp["terminated"],
                resp["truncated"],
                resp["info"],
            )
        except KeyError as e:
            raise MalformedObservation(f"step answer lacks {e}") from None

    def _release_session(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            try:
                request(self._addr, "POST", "/close", {"session": session}, self.timeout_s)
            except Exception:  # noqa: BLE001, S110 (best effort: the server reaps idle sessions)
                pass

    def close(self) -> None:
        self._release_session()
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                self._on_close()


class RemoteEnvFactory:
    """Makes RemoteEnvs over several servers: least-loaded first, round-robin on ties."""

    def __init__(self, addresses: Sequence[str], *, timeout_s: float = 30.0, down_s: float = 5.0):
        if not addresses:
            raise ValueError("addresses must name at least one server")
        for a in addresses:
            parse_address(a)
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.down_s = down_s
        self._load = [0] * len(addresses)
        self._down_until = [0.0] * len(addresses)
        self._next = 0
        self._lock = threading.Lock()

    def _pick(self) -> int:
        now = time.monotonic()
        n = len(self.addresses)
        up = [i for i in range(n) if self._down_until[i] <= now] or list(range(n))
        least = min(self._load[i] for i in up)
        for k in range(n):  # the first least-loaded server at or after the cursor
            i = (self._next + k) % n
            if i in up and self._load[i] == least:
                self._next = (i + 1) % n
                return i
        raise AssertionError("unreachable")

    def __call__(self, task: Task) -> RemoteEnv:
        with self._lock:
            i = self._pick()
            self._load[i] += 1
        return RemoteEnv(
            self.addresses[i],
            timeout_s=self.timeout_s,
            on_close=lambda: self._release(i),
            on_unreachable=lambda: self._mark_down(i),
        )

    def _release(self, i: int) -> None:
        with self._lock:
            self._load[i] -= 1

    def _mark_down(self, i: int) -> None:
        with self._lock:
            self._down_until[i] = time.monotonic() + self.down_s

    def loads(self) -> dict[str, int]:
        with self._lock:
            return dict(zip(self.addresses, self._load))

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for a in self.addresses:
            try:
                out[a] = request(parse_address(a), "GET", "/health", None, self.timeout_s)
            except Exception as e:  # noqa: BLE001 (a health report, not a failure)
                out[a] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return out
