"""scripts/paged_attention_probe.py on CPU: JAX's Pallas GPU paged kernel (interpret mode)
computes the engine's decode attention when the new token is written into the pool first,
the scores are pre-scaled and the pool is laid out `[K, P, S, H]` (what a GPU path needs)."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "paged_attention_probe.py"


def test_pallas_kernel_matches_the_gather_kernel_in_interpret_mode():
    done = subprocess.run([sys.executable, str(SCRIPT), "--slots", "3", "--pages", "8",
                           "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    difference = float(done.stdout.split("relative difference ")[1].split()[0])
    assert difference < 1e-5
    assert done.stdout.strip().splitlines()[-1].startswith("pallas_over_gather_time=nan")
