"""The env server: round trips equal to local envs, malformed requests, pool over servers."""

import asyncio
import http.client
import json
import socket
import subprocess
import sys

import pytest

from tidejax.envs import (
    EnvPool,
    EnvServer,
    PoolConfig,
    RemoteEnvFactory,
    ServerConfig,
    get_catalogue,
    make_env,
    make_expert,
    make_tasks,
)
from tidejax.envs.client import parse_address


@pytest.fixture(scope="module")
def server():
    get_catalogue()
    with EnvServer(port=0, max_body_bytes=4096) as s:
        yield s


def raw(server, method, path, body=None, headers=None):
    host, port = parse_address(server.address)
    conn = http.client.HTTPConnection(host, port, timeout=5)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, headers or {})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


@pytest.mark.parametrize("env_type", ["webshop", "household"])
def test_round_trip_equals_local_env(server, env_type):
    factory = RemoteEnvFactory([server.address])
    for task in make_tasks(env_type, "test", 3, 1, seed=4):
        local, remote = make_env(env_type), factory(task)
        expert = make_expert(local, env_type)
        obs, info = local.reset(options={"task": task})
        assert remote.reset(options={"task": task}) == (obs, json.loads(json.dumps(info)))
        done = False
        while not done:
            action = expert.act(obs, info)
            out = local.step(action)
            obs, info, done = out[0], out[4], out[2] or out[3]
            r_out = remote.step(action)
            assert r_out[:4] == out[:4] and r_out[4] == json.loads(json.dumps(info))
        assert out[1] == 1.0
        remote.close()
    assert factory.loads() == {server.address: 0}


def test_malformed_requests_get_4xx(server):
    task = make_tasks("webshop", "test", 1, 1, seed=0)[0].to_dict()
    cases = [
        (("POST", "/reset", b"{not json"), 400, "bad_json"),
        (("POST", "/reset", b"[1, 2]"), 400, "bad_request"),
        (("POST", "/reset", {"task": {"task_id": "x"}}), 400, "bad_request"),
        (("POST", "/reset", {"task": "webshop"}), 400, "bad_request"),
        (("POST", "/reset", {"task": {**task, "env_type": "chess"}}), 400, "bad_request"),
        (("POST", "/reset", {"task": {**task, "goal_index": 10**6}}), 400, "bad_request"),
        (("POST", "/reset", {"task": task, "seed": "seven"}), 400, "bad_request"),
        (("POST", "/step", {"session": "nope", "action": "click[x]"}), 404, "unknown_session"),
        (("POST", "/step", {"session": 3, "action": "click[x]"}), 400, "bad_request"),
        (("POST", "/step", {"session": "nope", "action": ["click"]}), 400, "bad_request"),
        (("POST", "/step", {"session": "s", "action": "x" * 5000}), 413, "too_large"),
        (("POST", "/teleport", {}), 404, "not_found"),
        (("GET", "/reset", None), 404, "not_found"),
        (("DELETE", "/reset", None), 405, "method_not_allowed"),
        (("POST", "/reset", b"x" * 5000), 413, "too_large"),
    ]
    for (method, path, body), status, kind in cases:
        got_status, got = raw(server, method, path, body)
        assert (got_status, got["error"]) == (status, kind), (path, body)
        assert got["message"]
    host, port = parse_address(server.address)
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.putrequest("POST", "/reset")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    assert conn.getresponse().status == 411
    conn.close()
    assert raw(server, "GET", "/health")[1]["ok"]  # still serving


def test_step_after_episode_end_and_close(server):
    task = make_tasks("household", "test", 1, 1, seed=0)[0]
    status, opened = raw(server, "POST", "/reset", {"task": {**task.to_dict(), "max_turns": 1}})
    assert status == 200
    sid = opened["session"]
    status, out = raw(server, "POST", "/step", {"session": sid, "action": "look"})
    assert status == 200 and out["truncated"]
    assert raw(server, "POST", "/step", {"session": sid, "action": "look"})[0] == 404
    assert raw(server, "POST", "/close", {"session": sid}) == (200, {"ok": True, "existed": False})


def test_factory_picks_least_loaded_then_round_robin():
    f = RemoteEnvFactory(["http://127.0.0.1:1", "127.0.0.1:2", "http://127.0.0.1:3"])
    task = make_tasks("webshop", "test", 1, 1, seed=0)[0]
    envs = [f(task) for _ in range(3)]
    assert [e.address for e in envs] == f.addresses
    envs[1].close()
    assert f(task).address == f.addresses[1]  # the only one with a free slot
    assert f.loads() == dict.fromkeys(f.addresses, 1)
    with pytest.raises(ValueError):
        RemoteEnvFactory(["no-port-here"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pool_over_servers_balances_and_fails_over():
    tasks = make_tasks("webshop", "eval", 6, 4, seed=5)
    get_catalogue()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here: connection refused
    with EnvServer(port=0) as a, EnvServer(port=0) as b:

        async def main():
            config = PoolConfig(capacity=8, max_retries=2)
            async with EnvPool(config, addresses=[dead, a.address, b.address]) as pool:

                async def one(task):
                    shadow = make_env("webshop")
                    expert = make_expert(shadow, "webshop")
                    obs, info = shadow.reset(options={"task": task})
                    r = await pool.reset(task)
                    while r.ok and not r.done:
                        action = expert.act(obs, info)
                        obs, _, _, _, info = shadow.step(action)
                        r = await pool.step(task.task_id, action)
                    return r

                return await asyncio.gather(*(one(t) for t in tasks)), pool.stats

        results, stats = asyncio.run(main())
        assert all(r.ok and r.reward == 1.0 for r in results)
        assert stats.exception >= 1 and stats.recovered >= 1  # the dead server was skipped
        assert a.store.opened > 0 and b.store.opened > 0
        assert abs(a.store.opened - b.store.opened) <= len(tasks) // 2
        assert len(a.store) == len(b.store) == 0  # finished sessions were dropped


def test_cli_binds_loopback_and_serves():
    assert ServerConfig().host == "127.0.0.1"
    cmd = [sys.executable, "-m", "tidejax.envs.server", "--port", "0", "--no-warm"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("tidejax env server listening on http://127.0.0.1:")
        host, port = parse_address(line.rsplit(" ", 1)[-1].strip())
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/health")
        health = json.loads(conn.getresponse().read())
        conn.close()
        assert health["ok"] and {"webshop", "household"} <= set(health["env_types"])
    finally:
        proc.terminate()
        proc.wait(timeout=10)
