"""`python -m tidejax.bench.ctb` on a small workload: three rows, the no-eviction
reference evicts nothing, and the last line carries every key."""

import re

import pytest

from tidejax.bench import ctb as bench_ctb


@pytest.mark.slow  # 34 s: two sets of engines compile
def test_the_no_eviction_reference_evicts_nothing_and_the_last_line_has_every_key(capsys):
    bench_ctb.main(["--groups", "3", "--group-size", "2", "--ranks", "1", "--num-pages", "128",
                    "--time-scale", "0.01", "--prefill-buckets", "256"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {line.split()[0]: dict(re.findall(r"(\w+)=([\d.]+)", line)) for line in lines[-4:-1]}
    assert set(rows) == {"request", "ctb", "no-evict"}
    assert int(rows["no-evict"]["evicted_pages"]) == 0
    assert int(rows["request"]["evicted_pages"]) > 0  # the baseline is under memory pressure
    # nothing evicted, so the reference recomputes less than the baseline that evicts
    assert int(rows["no-evict"]["prefill_tokens"]) < int(rows["request"]["prefill_tokens"])
    last = dict(pair.split("=") for pair in lines[-1].split())
    assert set(last) == {"ctb_hit_ratio", "prefill_ratio", "gen_throughput_ratio",
                         "no_evict_hit_ratio", "no_evict_prefill_ratio"}
    assert float(last["no_evict_prefill_ratio"]) < 1 < float(last["no_evict_hit_ratio"])
