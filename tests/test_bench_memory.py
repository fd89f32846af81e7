"""`python -m tidejax.bench.memory --config FILE` checks a user's own run configuration:
every partition the memory model admits for it, compiled on fake devices."""

import json

from tidejax.bench import memory as bench_memory


def test_a_users_config_is_checked_partition_by_partition(tmp_path, capsys):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"preset": "tiny", "device_memory_gib": 1.0,
                                "topology": {"devices": 4, "rollout_ranks": 1}}))
    bench_memory.main(["--config", str(path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("mine.json: capacity 0.8 GiB per device")
    partitions = [line for line in lines if line.strip().startswith("partition ")]
    fits, total = lines[-1].split()[0].removeprefix("fits_config=").split("/")
    assert int(total) == len(partitions) > 0 and int(fits) == int(total)
    assert "model_error=" in lines[-1]
