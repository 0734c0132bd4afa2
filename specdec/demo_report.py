"""The demo's printed tables, its markdown report and its comparison plot."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.fairness_report import format_number, markdown_table

if TYPE_CHECKING:
    from specdec.demo import DemoSettings
    from specdec.demo_pair import DemoPair


HEADLINE_KEYS = ("U_ce", "U_kl", "alpha_mean", "alpha_min", "worst_task", "speedup_min", "speedup_max",
                 "speedup_max_over_min", "tokens_per_call_max_over_min")


def headline(name: str, report: Any) -> dict[str, Any]:
    """The figures of one drafter's report that the comparison table shows (and ``report.json`` keeps)."""
    return {"drafter": name, **{key: report.summary.get(key) for key in HEADLINE_KEYS}}


def compact_table(report: Any) -> str:
    """The per-task figures a user needs on a terminal (the full table goes to the report file)."""
    columns = [("task", "name"), ("α_T", "alpha"), ("S_T", "speedup"), ("K_T (CE)", "cross_entropy"),
               ("D_T (KL)", "kl"), ("H_T(p)", "entropy"), ("α gen", "alpha_measured"), ("tok/call", "tokens_per_call")]
    lines = markdown_table([title for title, _ in columns],
                           ([getattr(row, key) for _, key in columns] for row in report.tasks))
    summary = report.summary
    lines.append("")
    lines.append(f"U (variance of K_T) = {format_number(summary.get('U_ce'))}, U on D_T = "
                 f"{format_number(summary.get('U_kl'))}; speed-up max/min = "
                 f"{format_number(summary.get('speedup_max_over_min'))}; mean α = "
                 f"{format_number(summary.get('alpha_mean'))}, worst α = {format_number(summary.get('alpha_min'))} "
                 f"({summary.get('worst_task')})")
    return "\n".join(lines) + "\n"


def comparison_markdown(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the headline figures, one row per drafter (original, s-CDF, baselines)."""
    headers = ["drafter", "U (CE)", "U (KL)", "mean α", "worst α", "worst task", "S min", "S max", "S max/min"]
    keys = ["drafter", *HEADLINE_KEYS[:-1]]
    return "\n".join(markdown_table(headers, ([row.get(key) for key in keys] for row in rows))) + "\n"


def plot_comparison(reports: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """PNG: per-task speed-up S_T and acceptance α_T for each drafter side by side, and U (CE) per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(reports)
    tasks = [row.name for row in next(iter(reports.values())).tasks]
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [3, 3, 1.4]})
    for panel, (attribute, title) in enumerate((("speedup", "speed-up S_T per task"),
                                                ("alpha", "acceptance α_T per task"))):
        ax = axes[panel]
        for index, name in enumerate(names):
            values = [float(getattr(reports[name].task(task), attribute) or float("nan")) for task in tasks]
            ax.bar([i + (index - (len(names) - 1) / 2) * width for i in range(len(tasks))], values, width, label=name)
        ax.set_xticks(range(len(tasks)))
        ax.set_xticklabels(tasks, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[1].set_ylim(0, 1)
    ax = axes[2]
    ax.bar(range(len(names)), [float(reports[name].summary.get("U_ce", float("nan"))) for name in names],
           color=[f"C{i}" for i in range(len(names))])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_title("unfairness U (variance of K_T)")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return Path(path)


def report_markdown(pair: DemoPair, settings: DemoSettings, cost_ratio: float, samples: Mapping[str, Any],
                    reports: Mapping[str, Any], comparison: list[dict[str, Any]], plot_paths: list[Path],
                    timings: Mapping[str, float], cost_ratio_given: bool = False) -> str:
    """The demo's ``report.md``: the setup, the comparison table, samples, every report's full table, the plots."""
    info = pair.info
    drafter_mixture = ", ".join(f"{task} {weight:.0%}" for task, weight in
                                info["config"]["drafter_training"]["mixture"])
    lines = [
        "# specdec demo report",
        "",
        "A small Llama-family verifier trained on every built-in task equally, and a smaller drafter trained on a "
        f"skewed mixture ({drafter_mixture}). The drafter is under-fit on its rare tasks, so speculative decoding "
        "accelerates them less. s-CDF finetunes only the drafter, pulling the tasks behind the best one toward the "
        "verifier; the verifier and therefore the output distribution are unchanged.",
        "",
        f"- verifier: {info['verifier_parameters']:,} parameters; drafter: {info['drafter_parameters']:,} parameters "
        f"({'loaded from the cache' if pair.cache_hit else 'trained in this run'}; `{pair.path}`)",
        f"- K = {settings.num_draft_tokens} drafts per round, temperature {settings.temperature}, cost ratio "
        f"c = {cost_ratio:.3g}; {settings.num_eval_examples} held-out prompts and texts per task. S_T is the "
        + ("speed-up predicted from α_T with the cost ratio c given on the command line (--cost-ratio). "
           if cost_ratio_given else
           "speed-up predicted from α_T with c = the drafter/verifier parameter ratio (a cost model for hardware "
           "where a forward pass costs in proportion to the weights it reads); models this small are overhead-bound "
           "on a CPU, so their wall-clock gains there are smaller. ")
        + "Tokens per verifier call (tok/call) are measured.",
        f"- s-CDF: {settings.finetune_steps} steps, {settings.finetune_batch_size_per_task} windows per task per step, "
        f"lr {settings.finetune_lr}, corrective weights on CE",
        f"- wall time: {timings.get('total_seconds', float('nan')):.0f} s",
        "",
        "## Summary",
        "",
        comparison_markdown(comparison),
        "U alone can be gamed by making the good tasks worse: read it together with the mean and the worst task's α.",
        "",
        "## Samples (greedy `specdec.generate`)",
        "",
    ]
    sample_rows = ([task, *(f"`{sample[key]!r}`" for key in ("prompt", "output", "expected")),
                    f"{sample['tokens_per_verifier_call']:.2f}"] for task, sample in samples.items())
    lines += markdown_table(["task", "prompt", "output", "expected", "tok/call"],
                            ([cell.replace("|", "\\|") for cell in row] for row in sample_rows))
    for name, report in reports.items():
        lines += ["", f"## Fairness: {name} drafter", "", report.to_markdown()]
    lines += ["", "## Plots", ""] + [f"![{path.stem}]({path.name})" for path in plot_paths]
    return "\n".join(lines) + "\n"
