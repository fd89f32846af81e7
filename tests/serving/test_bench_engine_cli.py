"""`python -m tidejax.bench.engine` as gpu_check runs it: a subset of decoders, no trace,
no padding; the last line carries every key."""

import re

import pytest
from tidejax.bench import engine as bench_engine


def test_decoder_subset_runs_and_the_last_line_has_every_key(capsys):
    bench_engine.main(["--slots", "2", "--timed-steps", "8", "--rounds", "1", "--skip-trace",
                       "--skip-padding", "--decoders", "engine_live_span"])
    lines = capsys.readouterr().out.strip().splitlines()
    rates = lines[1]
    for ran in (r"engine\(greedy\)", r"bare_dense\(argmax\)", r"engine\(live span\)"):
        assert float(re.search(ran + r"=(\S+)", rates).group(1)) > 0, ran
    assert re.search(r"engine\(1 token/call\)=nan", rates)  # not asked for
    last = dict(pair.split("=") for pair in lines[-1].split())
    assert set(last) == {"engine_overhead_ratio", "request_level_hit_rate", "roofline_fraction",
                         "host_ms_per_step", "prefill_padding"}
    assert float(last["roofline_fraction"]) > 0 and last["prefill_padding"] == "nan"


def test_an_unknown_decoder_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench_engine.main(["--decoders", "engine,warp_drive"])
    assert "warp_drive" in capsys.readouterr().err
