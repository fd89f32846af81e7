"""Per-GPU timelines: role (colour) and useful-busy utilisation (brightness) over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from tidejax.sim.metrics import RunResult

COLOURS = {
    "rollout": (0.12, 0.47, 0.71),
    "actor": (0.84, 0.15, 0.16),
    "ref": (0.58, 0.40, 0.74),
    "colocated": (0.17, 0.63, 0.17),
    "idle": (0.6, 0.6, 0.6),
}


def timeline_png(result: RunResult, path: str | Path) -> Path:
    """Write one PNG: GPUs on the y axis, time on the x axis."""
    if result.timeline is None:
        raise ValueError("result has no timeline")
    roles, util = result.timeline
    n_gpu, n_bin = len(roles), len(roles[0])
    img = np.ones((n_gpu, n_bin, 3))
    for g in range(n_gpu):
        for b in range(n_bin):
            base = np.array(COLOURS.get(roles[g][b], (0, 0, 0)))
            u = util[g][b]
            img[g, b] = 1.0 - (1.0 - base) * (0.15 + 0.85 * u)  # pale = idle, full = busy
    fig, ax = plt.subplots(figsize=(10, 0.18 * n_gpu + 1.6))
    ax.imshow(
        img,
        aspect="auto",
        interpolation="nearest",
        extent=(0, n_bin * result.bin_s, n_gpu - 0.5, -0.5),
    )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GPU")
    ax.set_title(
        f"{result.system} on {result.workload}: role (colour), useful utilisation "
        f"(depth); goodput {result.goodput:,.0f} tok/s",
        fontsize=9,
    )
    used = sorted({r for row in roles for r in row})
    ax.legend(
        handles=[Patch(color=COLOURS[r], label=r) for r in used if r in COLOURS],
        loc="upper right",
        fontsize=7,
        ncol=len(used),
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
