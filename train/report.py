"""Write a run's results: results.json, report.md and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

HEAD_COLORS = {"va": "tab:gray", "st": "tab:orange", "nmst": "tab:blue"}


def write_results(out: Path, results: dict[str, dict]) -> Path:
    """results.json: per head, test ``perplexity`` and ``r_nt`` (per decoder, L → ratio), plus the rest."""
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1))
    return path


def largest_L(curve: dict[str, float]) -> str:
    return max(curve, key=int)


def markdown(results: dict[str, dict], title: str, notes: list[str]) -> str:
    heads = list(results)
    decoders = list(next(iter(results.values()))["r_nt"])
    Ls = {d: " / ".join(dict.fromkeys(largest_L(r["r_nt"][d]) for r in results.values())) for d in decoders}
    lines = [f"# {title}", "", *notes, "", "## Perplexity (context excluded)", "",
             "| head | test | valid |", "|---|---:|---:|"]
    lines += [f"| {h} | {r['perplexity']:.3f} | {r['valid_perplexity']:.3f} |" for h, r in results.items()]
    lines += ["", "## Non-termination ratio r_nt(L) on the test contexts, at each run's largest L", "",
              "| decoder | L | " + " | ".join(heads) + " |", "|---|---:|" + "---:|" * len(heads)]
    for d in decoders:
        cells = [f"{results[h]['r_nt'][d][largest_L(results[h]['r_nt'][d])]:.3f}" for h in heads]
        lines.append(f"| {d} | {Ls[d]} | " + " | ".join(cells) + " |")
    lines += ["", "## Greedy continuations", ""]
    for h, r in results.items():
        for ex in r["examples"][:2]:
            lines.append(f"- **{h}** · context: _{ex['context']}_ → {ex['greedy']}")
    lines += ["", "Plots: `r_nt.png`, `p_eos.png`, `lengths.png`."]
    return "\n".join(lines) + "\n"


def plot_r_nt(out: Path, results: dict[str, dict]) -> None:
    decoders = list(next(iter(results.values()))["r_nt"])
    fig, axes = plt.subplots(1, len(decoders), figsize=(3.2 * len(decoders), 3), sharey=True)
    for ax, d in zip(axes, decoders):
        for h, r in results.items():
            curve = r["r_nt"][d]
            Ls = sorted(curve, key=int)
            # log-log: a ratio of 0 has no logarithm, so it is drawn at the axis floor
            ax.plot([int(L) for L in Ls], [max(curve[L], 1e-3) for L in Ls], label=h, color=HEAD_COLORS.get(h))
        ax.set(xscale="log", yscale="log", title=d, xlabel="L", ylim=(1e-3, 1.5))
    axes[0].set_ylabel("r_nt(L)")
    axes[-1].legend()
    fig.tight_layout()
    fig.savefig(out / "r_nt.png", dpi=110)
    plt.close(fig)


def plot_p_eos(out: Path, results: dict[str, dict]) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    first = next(iter(results.values()))["p_eos"]
    ax.plot(first["t"], first["data"], "k:", label="data eos rate")
    for h, r in results.items():
        ax.plot(r["p_eos"]["t"], r["p_eos"]["model"], label=h, color=HEAD_COLORS.get(h))
    ax.set(xlabel="t (tokens after the context)", ylabel="p(eos), teacher-forced", ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "p_eos.png", dpi=110)
    plt.close(fig)


def plot_lengths(out: Path, results: dict[str, dict], decoder: str = "greedy") -> None:
    fig, axes = plt.subplots(1, len(results), figsize=(3.5 * len(results), 3), sharey=True)
    for ax, (h, r) in zip(list(axes) if len(results) > 1 else [axes], results.items()):
        top = max(max(r["data_lengths"]), max(r["generated_lengths"][decoder]))
        bins = range(1, top + 2)
        ax.hist(r["data_lengths"], bins=bins, alpha=0.5, color="k", label="data", density=True)
        ax.hist(r["generated_lengths"][decoder], bins=bins, alpha=0.6, color=HEAD_COLORS.get(h),
                label=f"{h} {decoder}", density=True)
        ax.set(xscale="log", xlabel="continuation length", title=h)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "lengths.png", dpi=110)
    plt.close(fig)


def write_report(out: Path, results: dict[str, dict], title: str, notes: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, results)
    (out / "report.md").write_text(markdown(results, title, notes))
    plot_r_nt(out, results)
    plot_p_eos(out, results)
    plot_lengths(out, results)
