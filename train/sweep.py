"""An ε × seed sweep over heads and architectures, summarized as the paper's mean ± std tables.

    python -m train.sweep                                      # built-in corpus, ε ∈ {0.01, 0.001}, 3 seeds
    python -m train.sweep --data-dir DIR --archs rnn lstm --eps 1e-4 1e-5 --seeds 0 1 2 3 4 --device cuda
    torchrun --standalone --nproc_per_node 2 -m train.sweep ...    # each run data-parallel over 2 processes

Every (arch, head, ε, seed) trains in its own directory under ``--out`` (a rerun resumes and
skips finished runs' training); VA does not depend on ε and runs once per seed. Writes
``sweep.json`` (every run's perplexity and r_nt curves), ``tables.md`` (per architecture: test
perplexity and r_nt(L) at the largest L for every decoder, mean ± std over seeds, as in the
paper's Tables 1–3) and ``sweep_r_nt.png`` (greedy r_nt(L), mean over seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from nmst_fast.validation import HEADS

from .checkpoint import Diverged, claim_directory
from .distributed import World, launch, on_main
from .report import HEAD_COLORS, largest_L, plt
from .runner import (
    add_arguments,
    base_config,
    check_arguments,
    check_resumes,
    greedy_length,
    load_data,
    max_length,
    run_one,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--archs", nargs="+", default=["lstm"], metavar="ARCH")
    p.add_argument("--heads", nargs="+", default=list(HEADS), metavar="HEAD")
    p.add_argument("--eps", nargs="+", type=float, default=[1e-2, 1e-3])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    return p


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    if not all(math.isfinite(v) for v in values):  # statistics' exact arithmetic refuses inf and NaN
        bad = "NaN" if any(map(math.isnan, values)) else "inf"
        return f"{math.fsum(values) / len(values):.3f} (a seed's value is {bad})"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def tables(runs: list[dict]) -> str:
    """Markdown: one table per architecture, one row per (head, ε), mean ± std over seeds; r_nt at
    each run's largest L of each decoder (greedy's is a column: t½ of ε where that is larger)."""
    lines = ["# ε × seed sweep", ""]
    decoders = list(runs[0]["r_nt"])
    others = sorted({largest_L(r["r_nt"][d]) for r in runs for d in decoders if d != "greedy"}, key=int)
    for arch in dict.fromkeys(r["arch"] for r in runs):
        lines += [f"## {arch}: test perplexity and r_nt(L), mean ± std over seeds", "",
                  f"r_nt at L = {', '.join(others)} for every decoder but greedy, at the column's L for greedy.", "",
                  "| head | ε | seeds | perplexity | greedy L | " + " | ".join(decoders) + " |",
                  "|---|---|---:|---:|---:|" + "---:|" * len(decoders)]
        groups: dict[tuple, list[dict]] = {}
        for r in runs:
            if r["arch"] == arch:
                groups.setdefault((r["head"], r["eps"]), []).append(r)
        for (head, eps), rs in groups.items():
            cells = [_mean_std([r["r_nt"][d][largest_L(r["r_nt"][d])] for r in rs]) for d in decoders]
            greedy_Ls = "/".join(dict.fromkeys(largest_L(r["r_nt"]["greedy"]) for r in rs))
            lines.append(f"| {head} | {'—' if eps is None else f'{eps:g}'} | {len(rs)} | "
                         f"{_mean_std([r['perplexity'] for r in rs])} | {greedy_Ls} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


_STYLES = ("-", "--", ":", "-.")


def plot(out: Path, runs: list[dict], decoder: str = "greedy") -> None:
    archs = list(dict.fromkeys(r["arch"] for r in runs))
    eps_values = sorted({r["eps"] for r in runs if r["eps"] is not None})  # one line style per ε
    fig, axes = plt.subplots(1, len(archs), figsize=(5 * len(archs), 3.5), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        groups: dict[tuple, list[dict]] = {}
        for r in runs:
            if r["arch"] == arch:
                groups.setdefault((r["head"], r["eps"]), []).append(r)
        for (head, eps), rs in groups.items():
            Ls = sorted(rs[0]["r_nt"][decoder], key=int)
            mean = [statistics.mean(r["r_nt"][decoder][L] for r in rs) for L in Ls]
            style = "-" if eps is None else _STYLES[eps_values.index(eps) % len(_STYLES)]
            ax.plot([int(L) for L in Ls], [max(m, 1e-3) for m in mean], color=HEAD_COLORS.get(head), linestyle=style,
                    label=head if eps is None else f"{head} ε={eps:g}")
        ax.set(xscale="log", yscale="log", ylim=(1e-3, 1.5), xlabel="L", ylabel=f"r_nt(L), {decoder}", title=arch)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sweep_r_nt.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    parser = _parser()
    args = parser.parse_args(argv)
    # A value given twice would train one directory and count it twice in the mean ± std.
    for name in ("archs", "heads", "seeds"):
        setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    by_directory: dict[str, float] = {}  # ε values that name the same run directory are one
    for eps in args.eps:
        by_directory.setdefault(f"{eps:g}", eps)
    args.eps = list(by_directory.values())
    return launch(parser, args, check_arguments, lambda world: _run(parser, args, world))


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, world: World) -> Path:
    try:
        plan = []
        for arch in args.archs:
            for seed in args.seeds:
                for head in args.heads:
                    for eps in ([None] if head == "va" else args.eps):
                        config = replace(base_config(args, arch=arch, eps=eps, seed=seed), head=head).validate()
                        plan.append((config, eps))
        L = max_length(args)
        data = load_data(args, 0)  # one corpus; seeds vary the models

        def claim() -> Path:
            out = args.out or Path("runs") / ("sweep-" + time.strftime("%Y%m%d-%H%M%S"))
            claim_directory(out, dict(entry="train.sweep", source=data.source, data=data.fingerprint),
                            record=dict(world_size=world.size))
            return out

        out = on_main(claim, world)
        plan = [(config, eps, out / config.arch / config.head / ("any" if eps is None else f"eps{eps:g}")
                 / f"seed{config.seed}") for config, eps in plan]
        check_resumes([(config, run_dir) for config, _, run_dir in plan], data)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        parser.error(str(err))
    runs = []
    for config, eps, run_dir in plan:
        try:
            result = run_one(config, data, run_dir, L, progress=not args.quiet, eval_contexts=args.eval_contexts,
                             world=world, greedy_L=greedy_length(args, config))
        except Diverged as err:  # not a usage error: the run itself failed
            sys.exit(f"python -m train.sweep: {err}")
        runs.append(dict(arch=config.arch, head=config.head, eps=eps, seed=config.seed,
                         perplexity=result["perplexity"], r_nt=result["r_nt"]))
    if world.is_main:
        (out / "sweep.json").write_text(json.dumps(dict(source=data.source, max_length=L, world_size=world.size,
                                                        runs=runs), indent=1))
        (out / "tables.md").write_text(tables(runs))
        plot(out, runs)
        print(f"tables: {out / 'tables.md'}", flush=True)
    return out


if __name__ == "__main__":
    main()
