"""Goodput and stale drops of three systems under each simulator consume order.

    python scripts/consume_orders.py text-7b 40 completion,admission,deadline
"""

import sys

from tidejax.sim import systems
from tidejax.sim import workload as wl
from tidejax.sim.config import SimConfig


def main(preset: str, steps: int, orders: list[str]) -> None:
    spec = wl.preset(preset)
    lineup = (("tidejax", systems.tidejax()), ("streamrl@0.375", systems.streamrl(0.375)),
              ("areal@0.5", systems.areal(0.5)))
    for order in orders:
        cfg = SimConfig(steps=steps, consume_order=order)
        for name, system in lineup:
            r = systems.run(system, spec, cfg)
            print(f"{order:10s} {name:15s} goodput={r.goodput:8.0f} "
                  f"drops={r.dropped_groups:4d} max_staleness={r.max_staleness}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","))
