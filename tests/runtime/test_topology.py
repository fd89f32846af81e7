"""Topology as data: ranks are (process, local devices); roles are the same on every host."""

import dataclasses

import pytest

from tidejax.runtime.topology import Topology
from tidejax.sched import ers


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def two_hosts(local: int = 4) -> list[FakeDevice]:
    # Ids as JAX numbers them on two hosts: each process's devices in one block.
    return [FakeDevice(p * 1000 + i, p) for p in (1, 0) for i in range(local)]


def ids(devices) -> list[int]:
    return [d.id for d in devices]


def test_ranks_are_local_device_groups_of_each_process():
    topo = Topology.of(two_hosts(), per_process=4, rank_size=2)
    assert [[ids(rank) for rank in host] for host in topo.hosts] == [
        [[0, 1], [2, 3]], [[1000, 1001], [1002, 1003]]]
    assert topo.ranks_per_host == 2
    assert ids(topo.devices) == [0, 1, 2, 3, 1000, 1001, 1002, 1003]
    for process, host in enumerate(topo.hosts):
        assert {d.process_index for rank in host for d in rank} == {process}


def test_a_partition_applies_alike_on_every_host_so_meshes_are_rectangular():
    topo = Topology.of(two_hosts(), per_process=4, rank_size=1)
    rollout, ref, actor = topo.roles(ers.Partition(rollout=1, ref=1, actor=2))
    assert [ids(rank) for rank in rollout] == [[0], [1000]]
    assert ids(ref) == [1, 1001]
    assert ids(actor) == [2, 3, 1002, 1003]  # 2 hosts x 2 local devices, host by host
    for rank in rollout:  # an engine runs on devices of one process
        assert len({d.process_index for d in rank}) == 1


def test_one_process_is_the_one_host_case():
    devices = [FakeDevice(i, 0) for i in range(8)]
    topo = Topology.of(devices, per_process=6, rank_size=2)
    rollout, ref, actor = topo.roles(ers.Partition(rollout=2, actor=1))
    assert [ids(rank) for rank in rollout] == [[0, 1], [2, 3]]
    assert ref == [] and ids(actor) == [4, 5]


def test_too_few_devices_on_a_process_are_named():
    with pytest.raises(ValueError, match="process 1 has 3 device"):
        Topology.of([d for d in two_hosts() if d.id != 1003], per_process=4, rank_size=1)
    with pytest.raises(ValueError, match="rollout_tensor=3"):
        Topology.of(two_hosts(), per_process=4, rank_size=3)
