"""Serves the registered env types over HTTP/JSON, one session per episode.

    python -m tidejax.envs.server --host 127.0.0.1 --port 8765
    python -m tidejax.envs.server --env webshop --env my_pkg.envs:MyEnv --port 0

Env types: the built-ins, installed plugins (entry-point group `tidejax.envs`) and each
`--env NAME` (a "package.module:Class" name is imported at start, so a typo fails there).
A request's env_type is resolved when it arrives, so a plugin installed later is found;
a "module:Class" name not given by --env is refused unless --allow-import, since
resolving it imports code named by the client. Settings per env type (--env-kwargs) are
checked at start by the env's config class.

Endpoints (request and answer bodies are JSON objects):

    GET  /health  -> {"ok": true, "env_types": [...], "sessions": n}
    POST /reset   {"task": {Task fields}, "seed": int|null} -> {"session", "obs", "info"}
    POST /step    {"session": str, "action": str}
                  -> {"obs", "reward", "terminated", "truncated", "info"}
    POST /close   {"session": str} -> {"ok": true, "existed": bool}

Malformed requests get a 4xx and {"error": kind, "message": why}: 400 bad JSON or
fields, 404 unknown path or session, 405 wrong method, 411 no Content-Length, 413 body
over the limit. An env that raises gives 500 and its session is dropped; a full server
gives 503. Binds loopback unless --host says otherwise.

Concurrency: ThreadingHTTPServer runs one thread per connection (clients keep a few
keep-alive connections each). Sessions live in a dict under one lock; each session has
its own lock, so concurrent requests for one session run one at a time while different
sessions step in parallel. Sessions idle longer than the TTL are reaped when a new one
is opened, and finished episodes are dropped at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from tidejax.envs.protocol import (
    MAX_ACTION_CHARS,
    MAX_OBS_CHARS,
    MalformedObservation,
    Task,
    TextEnv,
    validate_reset,
    validate_step,
)
from tidejax.envs.registry import env_settings, env_types, get_spec, make_env, plugin_names

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    max_body_bytes: int = 64 * 1024
    max_action_chars: int = MAX_ACTION_CHARS
    max_obs_chars: int = MAX_OBS_CHARS
    max_sessions: int = 4096
    session_ttl_s: float = 900.0
    env_kwargs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Env types to resolve at start (built-in, plugin or "module:Class" names).
    env_types: tuple[str, ...] = ()
    # Whether a request may name a "module:Class" not in env_types (imports client-named code).
    allow_import: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 256:
            raise ValueError(f"max_body_bytes must be >= 256, got {self.max_body_bytes}")
        if self.max_action_chars < 1:
            raise ValueError(f"max_action_chars must be >= 1, got {self.max_action_chars}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")
        if self.max_obs_chars < 1:
            raise ValueError(f"max_obs_chars must be >= 1, got {self.max_obs_chars}")
        object.__setattr__(self, "env_types", tuple(self.env_types))
        for name in self.env_types:
            get_spec(name)  # an unknown name fails here, at start
        for name, settings in self.env_kwargs.items():
            try:
                env_settings(name, settings)
            except ValueError as e:
                raise ValueError(f"env_kwargs[{name!r}]: {e}") from None


class HTTPError(Exception):
    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


@dataclasses.dataclass
class _Session:
    env: TextEnv
    lock: threading.Lock
    last_used: float


class SessionStore:
    """Live env sessions; the request logic, free of HTTP."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self.opened = 0  # sessions ever opened (for load-balancing checks)

    def __len__(self) -> int:
        return len(self._sessions)

    def reset(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            task = Task.from_dict(body.get("task"))  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise HTTPError(400, "bad_request", f"task: {e}") from None
        self._check_env_type(task.env_type)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise HTTPError(400, "bad_request", "seed must be an integer or null")
        self._reap()
        if len(self._sessions) >= self.config.max_sessions:
            raise HTTPError(503, "full", f"{self.config.max_sessions} sessions are open")
        try:
            env = make_env(task.env_type, **self.config.env_kwargs.get(task.env_type, {}))
            out = env.reset(seed=seed, options={"task": task})
        except ValueError as e:  # e.g. a goal_index out of range: the request's fault
            raise HTTPError(400, "bad_request", str(e)) from None
        except Exception as e:  # noqa: BLE001 (any env failure becomes a 500, not a crash)
            raise HTTPError(500, "exception", f"{type(e).__name__}: {e}") from None
        try:
            obs, info = validate_reset(out, self.config.max_obs_chars)
        except MalformedObservation as e:
            _close_quietly(env)
            raise HTTPError(500, "malformed_observation", str(e)) from None
        sid = secrets.token_hex(12)
        with self._lock:
            self._sessions[sid] = _Session(env, threading.Lock(), time.monotonic())
            self.opened += 1
        return {"session": sid, "obs": obs, "info": info}

    def known_env_types(self) -> list[str]:
        return sorted({*env_types(), *plugin_names(), *self.config.env_types})

    def _check_env_type(self, name: str) -> None:
        """Resolves a request's env_type now (a plugin installed since start is found)."""
        if ":" in name and name not in self.config.env_types and not self.config.allow_import:
            raise HTTPError(400, "bad_request", f"unknown env_type {name!r}: start the server "
                                                f"with --env {name} (or --allow-import)")
        try:
            get_spec(name)
        except ValueError as e:
            raise HTTPError(400, "bad_request", f"unknown env_type {name!r}: {e}") from None

    def _get(self, body: dict[str, Any]) -> tuple[str, _Session]:
        sid = body.get("session")
        if not isinstance(sid, str):
            raise HTTPError(400, "bad_request", "session must be a string")
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            raise HTTPError(404, "unknown_session", f"no session {sid[:40]!r}")
        return sid, s

    def step(self, body: dict[str, Any]) -> dict[str, Any]:
        action = body.get("action")
        if not isinstance(action, str):
            raise HTTPError(400, "bad_request", "action must be a string")
        if len(action) > self.config.max_action_chars:
            raise HTTPError(400, "bad_request", f"action over {self.config.max_action_chars} chars")
        sid, s = self._get(body)
        with s.lock:
            s.last_used = time.monotonic()
            try:
                out = validate_step(s.env.step(action), self.config.max_obs_chars)
            except MalformedObservation as e:
                self._drop(sid)
                raise HTTPError(500, "malformed_observation", str(e)) from None
            except Exception as e:  # noqa: BLE001 (as in reset)
                self._drop(sid)
                raise HTTPError(500, "exception", f"{type(e).__name__}: {e}") from None
            obs, reward, terminated, truncated, info = out
        if terminated or truncated:
            self._drop(sid)
        return {
            "obs": obs,
            "reward": reward,
            "terminated": terminated,
            "truncated": truncated,
            "info": info,
        }

    def close(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = body.get("session")
        if not isinstance(sid, str):
            raise HTTPError(400, "bad_request", "session must be a string")
        return {"ok": True, "existed": self._drop(sid)}

    def _drop(self, sid: str) -> bool:
        with self._lock:
            s = self._sessions.pop(sid, None)
        if s is not None:
            _close_quietly(s.env)
        return s is not None

    def _reap(self) -> None:
        cutoff = time.monotonic() - self.config.session_ttl_s
        with self._lock:
            stale = [k for k, s in self._sessions.items() if s.last_used < cutoff]
        for k in stale:
            self._drop(k)


def _close_quietly(env: TextEnv) -> None:
    try:
        env.close()
    except Exception:  # a failing close must not stop the server
        log.exception("closing an env")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so a worker thread reuses its connection
    server_version = "tidejax-env/0.1"
    timeout = 120  # idle keep-alive connections close after this
    # Headers and body go out in two writes; with Nagle on, the second waits for the
    # client's delayed ACK (~40 ms a request).
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, obj: dict[str, Any], close: bool = False) -> None:
        try:
            body = json.dumps(obj, allow_nan=False).encode()
        except (TypeError, ValueError) as e:  # e.g. a NaN reward or a non-JSON info value
            status = 500
            body = json.dumps({"error": "exception", "message": f"unserialisable: {e}"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _error(self, e: HTTPError, close: bool = False) -> None:
        self._send(e.status, {"error": e.kind, "message": e.message}, close=close)

    def do_GET(self) -> None:
        if self.path == "/health":
            store = self.server.store
            self._send(200, {"ok": True, "env_types": store.known_env_types(),
                             "sessions": len(store)})
        else:
            self._error(HTTPError(404, "not_found", f"no route GET {self.path[:100]}"))

    def do_POST(self) -> None:
        store = self.server.store
        routes = {"/reset": store.reset, "/step": store.step, "/close": store.close}
        try:
            body = self._read_json()
        except HTTPError as e:
            # The body may be left unread, so this connection cannot carry another request.
            self._error(e, close=True)
            return
        route = routes.get(self.path)
        if route is None:
            self._error(HTTPError(404, "not_found", f"no route POST {self.path[:100]}"))
            return
        try:
            self._send(200, route(body))
        except HTTPError as e:
            self._error(e)

    def _read_json(self) -> dict[str, Any]:
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise HTTPError(411, "length_required", "Content-Length is required")
        try:
            length = int(raw)
        except ValueError:
            raise HTTPError(400, "bad_request", "Content-Length is not an integer") from None
        if length < 0:
            raise HTTPError(400, "bad_request", "Content-Length is negative")
        limit = self.server.store.config.max_body_bytes
        if length > limit:
            raise HTTPError(413, "too_large", f"body of {length} bytes > {limit}")
        data = self.rfile.read(length)
        try:
            body = json.loads(data)
        except ValueError as e:
            raise HTTPError(400, "bad_json", f"body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "bad_request", "body must be a JSON object")
        return body

    def _not_allowed(self) -> None:
        self._error(HTTPError(405, "method_not_allowed", f"{self.command} is not supported"))

    do_PUT = do_DELETE = do_PATCH = _not_allowed


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    store: SessionStore


class EnvServer:
    """An env server in this process, on a background thread (tests, benchmarks)."""

    def __init__(self, config: ServerConfig | None = None, **overrides: Any):
        self.config = config or ServerConfig(**overrides)
        self._httpd = _Server((self.config.host, self.config.port), _Handler)
        self._httpd.store = SessionStore(self.config)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def store(self) -> SessionStore:
        return self._httpd.store

    def start(self) -> EnvServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="env-server", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve tidejax text envs over HTTP/JSON.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    p.add_argument("--max-sessions", type=int, default=4096)
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024)
    p.add_argument("--session-ttl-s", type=float, default=900.0)
    p.add_argument("--env", action="append", default=[], dest="envs", metavar="NAME",
                   help="an env type to serve: built-in, plugin or 'package.module:Class' "
                        "(repeatable; built-ins and plugins are served without it)")
    p.add_argument("--allow-import", action="store_true",
                   help="let requests name any 'module:Class' (imports code a client names)")
    p.add_argument("--env-kwargs", default="{}", help='JSON, e.g. {"webshop": {...}}')
    p.add_argument("--no-warm", action="store_true", help="skip building envs before serving")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        env_kwargs = json.loads(args.env_kwargs)
        if not isinstance(env_kwargs, dict):
            raise ValueError("--env-kwargs must be a JSON object of env type -> settings")
        config = ServerConfig(
            host=args.host,
            port=args.port,
            max_body_bytes=args.max_body_bytes,
            max_sessions=args.max_sessions,
            session_ttl_s=args.session_ttl_s,
            env_kwargs=env_kwargs,
            env_types=tuple(args.envs),
            allow_import=args.allow_import,
        )
    except ValueError as e:  # an unknown env, bad settings: say so, no traceback
        print(f"tidejax env server: cannot start: {e}", file=sys.stderr)
        return 2
    if not args.no_warm:  # build catalogues now, not on the first request
        for t in args.envs or env_types():
            make_env(t, **env_kwargs.get(t, {})).close()
    server = EnvServer(config)
    # One line on stdout so a parent process can read the chosen port.
    print(f"tidejax env server listening on {server.address}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
