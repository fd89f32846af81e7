"""scripts/paged_attention_probe.py on CPU: JAX's Pallas GPU paged kernel (interpret mode)
computes the engine's decode attention when the new token is written into the pool first,
the scores are pre-scaled and the pool is laid out `[K, P, S, H]`; tidejax's own kernel
computes it on the engine's pool as it is."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "paged_attention_probe.py"


def test_pallas_kernel_matches_the_gather_kernel_in_interpret_mode():
    done = subprocess.run([sys.executable, str(SCRIPT), "--slots", "3", "--pages", "8",
                           "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    jax_kernel, ours = (float(part.split()[0])
                        for part in done.stdout.split("relative difference ")[1:3])
    assert jax_kernel < 1e-5 and ours < 1e-5
    assert done.stdout.strip().splitlines()[-1].startswith("pallas_over_gather_time=nan")
