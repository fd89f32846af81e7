"""Reproduce the paper's comparisons on the simulated 32-GPU cluster.

    python -m tidejax.experiments.simulate --table e2e        # all systems, 3 workloads
    python -m tidejax.experiments.simulate --table ablation   # StreamRL -> +RA2P -> +ERS -> +CTB
    python -m tidejax.experiments.simulate --table ctb        # 1312 WebShop tasks, one H100
    python -m tidejax.experiments.simulate --table ra2p       # 8 ready micro-batches, 4 H100
    python -m tidejax.experiments.simulate --table ers        # RWT + TWT vs fixed ratios
    python -m tidejax.experiments.simulate --table workload   # tail statistics of a workload
    python -m tidejax.experiments.simulate --table robustness # every system, a workload family
    python -m tidejax.experiments.simulate --table headroom   # what adapting the split could gain
    python -m tidejax.experiments.simulate --table timing     # seconds to simulate one run

``--workload FILE`` (TOML or JSON, the :class:`tidejax.sim.workload.WorkloadSpec` layout;
``--dump-workload text-7b`` prints a template) replaces the preset workloads. JSON results
and PNG timelines go under ``--out`` (default ``runs/simulate``, git-ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from tidejax.sim import family, tables, workload
from tidejax.sim.config import CONSUME_ORDERS, SimConfig
from tidejax.sim.costs import SwitchConstants


def _fmt_row(cols, widths):
    return "  ".join(
        str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cols, widths))
    )


def _print_table(header, rows, widths):
    print(_fmt_row(header, widths))
    for r in rows:
        print(_fmt_row(r, widths))


def _jsonable(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def _dump(out: Path, name: str, data) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(_jsonable(data), indent=1, default=str))
    return path


def _specs(args) -> list[workload.WorkloadSpec]:
    if args.workload:
        return [workload.load(args.workload)]
    return [workload.preset(name) for name in tables.E2E_WORKLOADS]


def table_e2e(args, cfg) -> None:
    blocks = []
    for spec in _specs(args):
        t0 = time.time()
        block = tables.e2e(spec, cfg, args.sweep_steps, args.jobs)
        blocks.append(block)
        ib, tb = block["ideal"], block["bound"]
        print(
            f"\n== e2e: {spec.name}, {cfg.steps} steps, {cfg.n_gpus} GPUs, staleness bound "
            f"{cfg.staleness_bound} ({time.time() - t0:.0f}s to simulate)\n"
            f"   goodput = generated tokens consumed by the trainer per second; ideal bound "
            f"{ib.goodput:,.0f}, tighter bound {tb.goodput:,.0f} (binds: {tb.binding}; "
            + ", ".join(f"{k} {v:,.0f}s" for k, v in tb.walls.items())
            + ")\n"
            f"   stream-order floor {block['stream_floor_s']:,.0f}s: a schedule admitting in "
            f"stream order with the quota full reaches at most "
            f"{tables.stream_ceiling(block):.2f} of the tighter bound"
        )
        rows = [
            [
                r["system"],
                f"{r['goodput']:,.0f}",
                f"{r['trained_tok_s']:,.0f}",
                f"{r['x_sync']:.2f}",
                f"{r['x_best_fixed']:.2f}",
                f"{r['of_ideal']:.2f}",
                f"{r['of_bound']:.2f}",
                f"{r['rwt_gpu_h']:.2f}",
                f"{r['twt_gpu_h']:.2f}",
                f"{r['kv_hit']:.3f}",
                f"{r['staleness']:.2f}/{r['max_staleness']}",
                str(r["dropped_groups"]),
                f"{r['step_s']:.1f}",
                f"{r['sim_s']:.0f}",
            ]
            for r in tables.e2e_rows(block)
        ]
        _print_table(
            [
                "system",
                "goodput tok/s",
                "trained tok/s",
                "x sync",
                "x best fixed",
                "of ideal",
                "of bound",
                "RWT GPU-h",
                "TWT GPU-h",
                "KV hit",
                "staleness",
                "dropped",
                "step s",
                "sim s",
            ],
            rows,
            [15, 13, 13, 6, 12, 8, 8, 9, 9, 6, 9, 7, 6, 5],
        )
        _print_bidirl(block["results"])
        sweep = {k: [(r.system, round(r.goodput)) for r in v] for k, v in block["swept"].items()}
        c = block["sweep_cost"]
        print(
            f"   fixed-ratio sweep ({args.sweep_steps} steps each): {sweep}\n"
            f"   sweep cost: {c['runs']} runs, {c['gpu_h']:.1f} GPU-h of cluster time, then "
            f"{c['full_reruns']} full reruns; best fixed "
            f"{tables.best_fixed(block['results']).system}"
        )
        _print_breakdown(block["results"])
        folder = args.out / "e2e" / spec.name
        tables.save_timelines(block["results"], folder)
        _dump(
            args.out / "e2e",
            spec.name,
            {
                "workload": spec,
                "config": cfg,
                "ideal": ib,
                "bound": tb,
                "stream_floor_s": block["stream_floor_s"],
                "sweep_cost": c,
                "rows": tables.e2e_rows(block),
                "runs": [r.summary() for r in block["results"]],
                "sweep": {k: [r.summary() for r in v] for k, v in block["swept"].items()},
            },
        )
    print(f"\nJSON and PNG timelines under {args.out / 'e2e'}")
    for b in blocks:
        t = next(r for r in tables.e2e_rows(b) if r["system"] == "tidejax")
        print(
            f"{b['spec'].name}: tidejax x best fixed {t['x_best_fixed']:.2f}, "
            f"of bound {t['of_bound']:.2f} (stream-order ceiling "
            f"{tables.stream_ceiling(b):.2f})"
        )
    main = next((b for b in blocks if b["spec"].name == "text-qwen2.5-7b"), blocks[0])
    rows = tables.e2e_rows(main)
    tide = next(r for r in rows if r["system"] == "tidejax")
    areal = next(r for r in rows if r["system"].startswith("areal@"))
    print(
        f"tide_over_sync={tide['x_sync']:.2f} "
        f"tide_over_best_async={tide['goodput'] / areal['goodput']:.2f} "
        f"tide_over_ideal={tide['of_ideal']:.2f} "
        f"tide_over_best_fixed={tide['x_best_fixed']:.2f} tide_over_bound={tide['of_bound']:.2f}"
    )


def _print_bidirl(results) -> None:
    """What the BiDiRL mechanisms did: the planner's split, borrow offers and borrows."""
    for r in results:
        if "planner" not in r.extra and "borrow_checks" not in r.extra:
            continue
        p = r.extra.get("planner")
        plan = (
            f"planner {p['rollout_gpus']}R/{p['train_gpus']}T "
            f"(T_roll {p['t_rollout']:.1f}s, T_train {p['t_train']:.1f}s)"
            if p
            else "no planner"
        )
        c, b = r.extra.get("borrow_checks", {}), r.extra.get("borrows", {})
        print(
            f"   {r.system}: {plan}; borrows to_train={b.get('to_train', 0)} "
            f"to_rollout={b.get('to_rollout', 0)} of bubbles to_train={c.get('to_train', 0)} "
            f"(longest window {c.get('max_train_win', 0):.1f}s) "
            f"to_rollout={c.get('to_rollout', 0)} "
            f"(longest window {c.get('max_rollout_win', 0):.1f}s)"
        )


def _print_breakdown(results) -> None:
    kinds = [
        "decode",
        "prefill",
        "recompute",
        "ref",
        "actor",
        "swap",
        "sync",
        "switch",
        "idle_rollout_throttled",
        "idle_rollout_other",
        "idle_trainer",
    ]
    print("   where the GPU-hours go:")
    print("   " + _fmt_row(["system"] + kinds, [15] + [9] * len(kinds)))
    for r in results:
        vals = [f"{r.breakdown.get(k, 0.0) / 3600:.2f}" for k in kinds]
        print("   " + _fmt_row([r.system] + vals, [15] + [9] * len(kinds)))


def table_ablation(args, cfg) -> None:
    spec = workload.load(args.workload) if args.workload else workload.preset("osworld")
    swept = tables.sweep(workload_family("streamrl"), spec, cfg, args.sweep_steps, args.jobs)
    start = float(max(swept, key=lambda r: r.goodput).system.split("@")[1])
    res = tables.ablation(spec, cfg, start, args.jobs)
    print(f"== ablation on {spec.name} (all start from StreamRL's best split {start:g})")
    base = res[0].goodput
    rows, prev = [], base
    for r in res:
        first = r.extra.get("first_step_s")
        rows.append(
            [
                r.system,
                f"{r.goodput:,.0f}",
                f"{r.goodput / base:.3f}",
                f"{100 * (r.goodput / prev - 1):+.1f}%",
                f"{r.rwt_gpu_s / 3600:.2f}",
                f"{r.twt_gpu_s / 3600:.2f}",
                f"{r.breakdown.get('swap', 0) / 3600:.2f}",
                f"{r.kv_hit_rate:.3f}",
                f"{first:.1f}" if first else "-",
            ]
        )
        prev = r.goodput
    _print_table(
        [
            "system",
            "goodput",
            "x base",
            "step gain",
            "RWT GPU-h",
            "TWT GPU-h",
            "swap GPU-h",
            "KV hit",
            "1st step s",
        ],
        rows,
        [15, 10, 7, 9, 9, 9, 10, 6, 10],
    )
    _print_breakdown(res)
    tables.save_timelines(res, args.out / "ablation")
    _dump(args.out, "ablation", [r.summary() for r in res])


def workload_family(name):
    from tidejax.sim import systems

    return {"areal": systems.areal, "streamrl": systems.streamrl}[name]


def table_ctb(args, cfg) -> None:
    rows = tables.ctb_bench(n=args.jobs)
    print("== CTB: one rollout step of 1312 WebShop tasks on one H100 (Qwen2.5-7B)")
    _print_table(
        ["policy", "KV hit", "gen tok/s", "step s", "recompute GPU-s", "pauses"],
        [
            [
                r["policy"],
                f"{r['kv_hit_rate']:.3f}",
                f"{r['gen_tok_s']:,.0f}",
                f"{r['step_s']:.1f}",
                f"{r['recompute_gpu_s']:.1f}",
                r["pauses"],
            ]
            for r in rows
        ],
        [14, 7, 10, 8, 15, 7],
    )
    req, ctb_ = rows
    print(
        f"ctb_hit_gain={ctb_['kv_hit_rate'] / max(req['kv_hit_rate'], 1e-9):.2f} "
        f"ctb_gen_gain={ctb_['gen_tok_s'] / req['gen_tok_s']:.2f} "
        f"ctb_step_cut={1 - ctb_['step_s'] / req['step_s']:.3f}"
    )
    _dump(args.out, "ctb", rows)


def table_ra2p(args, cfg) -> None:
    res = tables.ra2p_bench()
    print("== RA2P: 8 ready micro-batches of 8192 tokens on 4 H100 (Qwen2.5-7B), step seconds")
    rows = []
    for layout, r in res.items():
        t = r["step_s"]
        rows.append(
            [
                layout,
                f"{t['VS']:.2f}",
                f"{t['VSO']:.2f}",
                f"{t['CM']:.2f}",
                f"{t['DM']:.2f}",
                f"{r['swap_s']:.2f}",
                r["ra2p_mode"],
                f"{r['ra2p_over_vso']:.3f}",
            ]
        )
    _print_table(
        ["layout", "VS", "VSO", "CM", "DM", "swap s", "RA2P picks", "RA2P/VSO"],
        rows,
        [11, 6, 6, 6, 6, 7, 10, 8],
    )
    print(
        "VS: streaming, both models resident (actor recomputes activations); VSO: streaming "
        "with offload; CM/DM: RA2P colocated (aggregated) / decoupled (1 Ref + 3 Actor)"
    )
    print(f"ra2p_over_vso={res['replicated']['ra2p_over_vso']:.3f}")
    _dump(args.out, "ra2p", res)


def table_ers(args, cfg) -> None:
    res = tables.ers_bench(cfg, args.jobs)
    print(f"== ERS: WebShop on one 8-GPU node, {cfg.steps} steps (CTB + RA2P in every run)")
    fixed = [r for r in res if r.system.startswith("fixed@")]
    best = max(fixed, key=lambda r: r.goodput)
    rows = []
    for r in res:
        wait = (r.rwt_gpu_s + r.twt_gpu_s) / 3600
        rows.append(
            [
                r.system,
                f"{r.goodput:,.0f}",
                f"{r.rwt_gpu_s / 3600:.2f}",
                f"{r.twt_gpu_s / 3600:.2f}",
                f"{wait:.2f}",
                f"{(r.rwt_gpu_s + r.twt_gpu_s) / (best.rwt_gpu_s + best.twt_gpu_s):.2f}",
            ]
        )
    _print_table(
        ["system", "goodput", "RWT GPU-h", "TWT GPU-h", "RWT+TWT", "/ best fixed"],
        rows,
        [12, 9, 9, 9, 8, 12],
    )
    ers = res[-1]
    print(f"best fixed ratio by goodput: {best.system}")
    print(
        f"ers_wait_over_best_fixed="
        f"{(ers.rwt_gpu_s + ers.twt_gpu_s) / (best.rwt_gpu_s + best.twt_gpu_s):.3f} "
        f"ers_goodput_over_best_fixed={ers.goodput / best.goodput:.3f}"
    )
    tables.save_timelines(res, args.out / "ers")
    _dump(args.out, "ers", [r.summary() for r in res])


def _family_members(args, cfg) -> list:
    """The robustness sample the family flags describe."""
    gpus = tuple(int(x) for x in args.family_gpus.split(","))
    return family.sample(args.family_size, args.family_seed, cfg.steps, gpus)


def table_robustness(args, cfg) -> None:
    """Every system over a fixed sample of the workload family (tidejax.sim.family)."""
    members = _family_members(args, cfg)
    print(
        f"== robustness: {len(members)} members of the workload family (seed "
        f"{args.family_seed}, GPUs from {args.family_gpus}), {cfg.steps} steps each, staleness "
        f"bound {cfg.staleness_bound}, fixed splits swept {args.sweep_steps} steps\n"
        "   each system's goodput / the best fixed split's (best of the AReaL-like and "
        "StreamRL-like sweeps, rerun in full); ceiling: the most of the tighter bound a "
        "stream-order schedule reaches (stream-order floor); x cap: that over the best fixed",
        flush=True,
    )
    rows, widths = [], None
    t0 = time.time()
    for m in members:  # one member at a time, each row printed as it finishes
        (row,) = tables.robustness([m], cfg, args.sweep_steps, args.jobs)
        rows.append(row)
        systems_ = list(row["over_best_fixed"])
        short = systems_
        if widths is None:
            widths = [28, 6, 4, 14, 9] + [max(6, len(x)) for x in short] + [8, 8, 8, 8]
            print(_fmt_row(["member", "drift", "GPUs", "best fixed", "tok/s"] + short
                           + ["of bound", "ceiling", "x cap", "sim s"], widths))
        cells = [m.spec.name, m.drift, m.n_gpus, row["best_fixed"]]
        cells += [f"{row['best_fixed_goodput']:,.0f}"]
        cells += [f"{row['over_best_fixed'][s]:.2f}" for s in systems_]
        cells += [f"{row['tide_of_bound']:.2f}", f"{row['stream_ceiling']:.2f}",
                  f"{row['cap_over_best_fixed']:.2f}", f"{time.time() - t0:.0f}"]
        print(_fmt_row(cells, widths), flush=True)
    print("   worst / median of each system over the best fixed split:")
    for s in rows[0]["over_best_fixed"]:
        st = tables.ratio_summary(rows, s)
        print(
            f"   {s:15s} all {st['worst']:.2f} / {st['median']:.2f}   "
            f"non-stationary {st['nonstationary_worst']:.2f} / {st['nonstationary_median']:.2f}"
        )
    path = _dump(args.out, "robustness", {"members": members, "config": cfg, "rows": rows})
    print(f"JSON under {path}")
    st = tables.ratio_summary(rows)
    print(
        f"tide_worst_over_best_fixed={st['worst']:.2f} "
        f"tide_median_over_best_fixed={st['median']:.2f} "
        f"tide_nonstationary_worst={st['nonstationary_worst']:.2f} "
        f"tide_nonstationary_median={st['nonstationary_median']:.2f}"
    )


def table_headroom(args, cfg) -> None:
    """On the non-stationary members of the robustness sample: how far tidejax's mechanisms
    at a fixed split, and a split adapted phase by phase, could take it past the best fixed
    baseline."""
    members = _family_members(args, cfg)
    members = [m for m in members if not m.stationary]
    print(
        f"== headroom: the {len(members)} non-stationary members of the robustness sample "
        f"(seed {args.family_seed}, GPUs from {args.family_gpus}), {cfg.steps} steps each; every "
        f"fixed split run in full; oracles switch split for free at {args.phases} phase "
        "boundaries\n   each figure over the best fixed baseline (AReaL-like or StreamRL-like)",
        flush=True,
    )
    widths = [28, 15, 9, 8, 16, 8, 9, 9]
    print(_fmt_row(["member", "best fixed", "tok/s", "tidejax", "best tidejax-fixed", "x",
                    "oracle b", "oracle t"], widths))
    rows = []
    for m in members:
        (row,) = tables.headroom([m], cfg, args.phases, args.jobs)
        rows.append(row)
        x = row["over_best_fixed"]
        print(_fmt_row([m.spec.name, row["best_fixed"], f"{row['best_fixed_goodput']:,.0f}",
                        f"{x['tidejax']:.3f}", row["best_tidejax_fixed"],
                        f"{x['tidejax_fixed']:.3f}", f"{x['baseline_oracle']:.3f}",
                        f"{x['tidejax_fixed_oracle']:.3f}"], widths), flush=True)
        print(f"   oracle t picks {' > '.join(row['tidejax_fixed_oracle_pick'])}", flush=True)
    print("   oracle b / oracle t: the best baseline / tidejax-fixed split chosen per phase")
    path = _dump(args.out, "headroom", {"members": members, "config": cfg, "rows": rows})
    print(f"JSON under {path}")
    st = {k: tables.ratio_summary(rows, k) for k in ("tidejax_fixed", "tidejax_fixed_oracle")}
    print(
        f"tidejax_fixed_worst={st['tidejax_fixed']['worst']:.3f} "
        f"tidejax_fixed_median={st['tidejax_fixed']['median']:.3f} "
        f"oracle_worst={st['tidejax_fixed_oracle']['worst']:.3f} "
        f"oracle_median={st['tidejax_fixed_oracle']['median']:.3f}"
    )


def table_workload(args, cfg) -> None:
    print("== workload tails (synchronous run; calibration rows workload.*)")
    for spec in _specs(args):
        t = tables.workload_tails(spec)
        print(f"{spec.name:22s} " + " ".join(f"{k}={v:.2f}" for k, v in t.items()))


def table_timing(args, cfg) -> None:
    """Cost of simulating: one tidejax run (``--steps`` steps, 32 GPUs) in this process."""
    from tidejax.sim import systems

    spec = _specs(args)[0]
    r = systems.run(systems.tidejax(), spec, cfg)
    print(
        f"== timing: tidejax on {spec.name}, {cfg.steps} steps, {cfg.n_gpus} GPUs: "
        f"goodput {r.goodput:,.1f} tok/s"
    )
    print(f"sim_wall_s={r.extra['sim_s']:.1f} sim_cpu_s={r.extra['sim_cpu_s']:.1f}")


TABLES = {
    "e2e": table_e2e,
    "timing": table_timing,
    "ablation": table_ablation,
    "ctb": table_ctb,
    "ra2p": table_ra2p,
    "ers": table_ers,
    "workload": table_workload,
    "robustness": table_robustness,
    "headroom": table_headroom,
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", choices=sorted(TABLES), default="e2e")
    p.add_argument("--workload", type=Path, help="workload description (TOML or JSON)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--gpus", type=int, default=SimConfig().n_gpus, help="simulated GPUs")
    p.add_argument(
        "--sweep-steps",
        type=int,
        default=25,
        help="steps of each fixed-ratio sweep run (the best ratio reruns in full)",
    )
    p.add_argument("--staleness", type=int, default=SimConfig().staleness_bound)
    p.add_argument(
        "--consume-order",
        choices=CONSUME_ORDERS,
        default=SimConfig().consume_order,
        help="the order the trainer takes finished groups in (see SimConfig.consume_order)",
    )
    p.add_argument(
        "--unanchored-eval",
        action="store_true",
        help="what-if: an evaluation does not hold the next weight sync (see "
        "SimConfig.anchored_eval; the runtime's evaluation is anchored)",
    )
    p.add_argument(
        "--switch-cost",
        choices=("hidden", "measured"),
        default="hidden",
        help="ERS role switch hidden under the weight sync (TideRL) or charged PEARL's c_in/c_out",
    )
    p.add_argument("--jobs", type=int, default=tables.default_jobs())
    p.add_argument(
        "--family-size", type=int, default=8, help="robustness: members of the family sample"
    )
    p.add_argument("--family-seed", type=int, default=0, help="robustness: the sample's seed")
    p.add_argument(
        "--family-gpus",
        default=",".join(str(n) for n in family.GPU_COUNTS),
        help="robustness: GPU counts members draw from (comma-separated)",
    )
    p.add_argument(
        "--phases", type=int, default=4, help="headroom: phases the oracle may switch between"
    )
    p.add_argument("--out", type=Path, default=Path("runs/simulate"))
    p.add_argument(
        "--dump-workload",
        metavar="PRESET",
        choices=tables.E2E_WORKLOADS,
        help="print a preset as JSON (a template for --workload) and exit",
    )
    args = p.parse_args(argv)
    if args.dump_workload:
        print(json.dumps(_jsonable(workload.preset(args.dump_workload)), indent=1))
        return
    if not 1 <= args.phases <= args.steps:
        p.error(f"--phases must be between 1 and --steps ({args.steps}), got {args.phases}")
    switch = SwitchConstants(ers_hidden_under_sync=args.switch_cost == "hidden")
    cfg = SimConfig(
        steps=args.steps,
        n_gpus=args.gpus,
        staleness_bound=args.staleness,
        consume_order=args.consume_order,
        anchored_eval=not args.unanchored_eval,
        switch=switch,
    )
    TABLES[args.table](args, cfg)


if __name__ == "__main__":
    main()
