"""The job's devices as data: hosts of ranks, and the roles a partition gives them.

A rank is (process, local device group): `rollout_tensor` consecutive devices of one
process, one rollout engine's tensor-parallel group and the unit ERS moves. A partition
counts ranks per host and is applied the same way on every host, so the actor and
reference meshes are rectangular (hosts x local devices) and every engine runs on devices
its own process drives. One process is the one-host case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tidejax.sched import ers


@dataclasses.dataclass(frozen=True)
class Topology:
    """hosts[p][r]: the devices of local rank r on process p (every host alike)."""

    hosts: tuple[tuple[tuple, ...], ...]

    @classmethod
    def of(cls, devices: Sequence, per_process: int, rank_size: int) -> Topology:
        """The first `per_process` devices (by id) of every process, cut into ranks of
        `rank_size`. `devices` is every device of the job (`jax.devices()`)."""
        by_process: dict[int, list] = {}
        for device in sorted(devices, key=lambda d: d.id):
            by_process.setdefault(device.process_index, []).append(device)
        if per_process % rank_size:
            raise ValueError(f"topology.rollout_tensor={rank_size} must divide the devices "
                             f"per process ({per_process})")
        hosts = []
        for process, local in sorted(by_process.items()):
            if len(local) < per_process:
                raise ValueError(f"topology.devices={per_process} per process, but process "
                                 f"{process} has {len(local)} device(s)")
            local = local[:per_process]
            hosts.append(tuple(tuple(local[i:i + rank_size])
                               for i in range(0, per_process, rank_size)))
        return cls(tuple(hosts))

    @property
    def ranks_per_host(self) -> int:
        return len(self.hosts[0])

    @property
    def devices(self) -> list:
        """Every device of the job, host by host."""
        return [d for host in self.hosts for rank in host for d in rank]

    def local_ranks(self, process: int) -> list[tuple]:
        return list(self.hosts[process])

    def roles(self, partition: ers.Partition) -> tuple[list[tuple], list, list]:
        """(rollout ranks of every host, reference devices, actor devices): on each host the
        first `partition.rollout` ranks roll out, the next `partition.ref` serve the
        reference and the rest train (so a move touches one edge). Mesh devices are listed
        host by host, so meshes are rectangular across hosts."""
        r, f = partition.rollout, partition.ref
        rollout = [rank for host in self.hosts for rank in host[:r]]
        ref = [d for host in self.hosts for rank in host[r:r + f] for d in rank]
        actor = [d for host in self.hosts for rank in host[r + f:] for d in rank]
        return rollout, ref, actor
