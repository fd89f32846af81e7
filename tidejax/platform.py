"""Process setup that must happen before jax is imported (no jax import here).

On CPU, tidejax fakes a multi-device host with `--xla_force_host_platform_device_count`.
Fake devices share the machine's few cores, so a collective can wait a long time for its
slowest participant; XLA's default 40 s stuck-collective termination would then kill a
healthy run, hence the longer timeouts.
"""

from __future__ import annotations

import os

CPU_COLLECTIVE_FLAGS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=600",
                        "--xla_cpu_collective_call_terminate_timeout_seconds=3600")


def configure_cpu_devices(count: int = 8, environ: dict | None = None) -> None:
    """Ask XLA for `count` CPU devices (unless the caller already chose) and long timeouts."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    parts = [flags] if flags else []
    if "xla_force_host_platform_device_count" not in flags:
        parts.append(f"--xla_force_host_platform_device_count={count}")
    for flag in CPU_COLLECTIVE_FLAGS:
        if flag.split("=")[0] not in flags:
            parts.append(flag)
    env["XLA_FLAGS"] = " ".join(parts)
