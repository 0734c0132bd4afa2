"""The demo's printed tables, its markdown report and its comparison plot."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.fairness.report import (
    columns_with_values,
    cost_ratio_line,
    format_number,
    mark_no_speedup,
    markdown_table,
    speed_warnings,
)

if TYPE_CHECKING:
    from specdec.cli.demo_pair import DemoPair, DemoSettings
    from specdec.fairness import CostRatio


COMPARISON_COLUMNS = (
    ("drafter", "drafter"), ("U (CE)", "U_ce"), ("U (KL)", "U_kl"), ("mean α", "alpha_mean"), ("worst α", "alpha_min"),
    ("worst task", "worst_task"), ("S predicted min", "speedup_predicted_min"),
    ("S predicted max", "speedup_predicted_max"), ("S predicted max/min", "speedup_predicted_max_over_min"),
    ("S measured min", "speedup_measured_min"), ("S measured max", "speedup_measured_max"),
    ("tok/call max/min", "tokens_per_call_max_over_min"),
)
"""The comparison table's (header, key) pairs: ``drafter`` is the drafter's name, the other keys are summary keys
of its report."""

_COMPACT_COLUMNS = (
    ("task", "name"), ("α_T", "alpha"), ("S predicted", "speedup_predicted"), ("S measured", "speedup_measured"),
    ("K_T (CE)", "cross_entropy"), ("D_T (KL)", "kl"), ("H_T(p)", "entropy"), ("α gen", "alpha_measured"),
    ("tok/call", "tokens_per_call"),
)


def headline(name: str, report: Any) -> dict[str, Any]:
    """The figures of one drafter's report that the comparison table shows (and ``report.json`` keeps)."""
    return {"drafter": name, **{key: report.summary.get(key) for _, key in COMPARISON_COLUMNS[1:]}}


def compact_table(report: Any) -> str:
    """The per-task figures a user needs on a terminal (the full table goes to the report file)."""
    columns = columns_with_values(_COMPACT_COLUMNS, report.tasks)
    lines = markdown_table([title for title, _ in columns],
                           ([getattr(row, key) for _, key in columns] for row in report.tasks))
    summary = report.summary
    lines.append("")
    lines.append(f"U (variance of K_T) = {format_number(summary.get('U_ce'))}, U on D_T = "
                 f"{format_number(summary.get('U_kl'))}; predicted speed-up max/min = "
                 f"{format_number(summary.get('speedup_predicted_max_over_min'))}; mean α = "
                 f"{format_number(summary.get('alpha_mean'))}, worst α = {format_number(summary.get('alpha_min'))} "
                 f"({summary.get('worst_task')})")
    lines += speed_warnings(report.tasks)
    return "\n".join(lines) + "\n"


def comparison_markdown(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the headline figures, one row per drafter (original, s-CDF, baselines); a column no
    drafter has a value for (e.g. the measured ones without the wall clock) is left out."""
    columns = columns_with_values(COMPARISON_COLUMNS, rows, lambda row, key: row.get(key))
    return "\n".join(markdown_table([title for title, _ in columns],
                                    ([row.get(key) for _, key in columns] for row in rows))) + "\n"


def comparison_figure(reports: Mapping[str, Any]) -> Any:
    """The matplotlib figure of :func:`plot_comparison` (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(reports)
    tasks = [row.name for row in next(iter(reports.values())).tasks]
    measured = any(row.speedup_measured is not None for report in reports.values() for row in report.tasks)
    panels = [("speedup_predicted", "predicted speed-up S(α_T, K, c) per task")]
    if measured:
        panels.append(("speedup_measured", "measured wall-clock speed-up per task\n(tokens/s of specdec.generate "
                                           "over tokens/s of verifier.generate)"))
    panels.append(("alpha", "acceptance α_T per task"))
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * len(panels) + 3, 5), layout="constrained",
                             gridspec_kw={"width_ratios": [3] * len(panels) + [1.4]})
    for ax, (attribute, title) in zip(axes, panels, strict=False):
        for index, name in enumerate(names):
            values = [float("nan") if getattr(reports[name].task(task), attribute) is None
                      else float(getattr(reports[name].task(task), attribute)) for task in tasks]
            ax.bar([i + (index - (len(names) - 1) / 2) * width for i in range(len(tasks))], values, width, label=name,
                   color=f"C{index}")
        ax.set_xticks(range(len(tasks)))
        ax.set_xticklabels(tasks, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        if attribute == "alpha":
            ax.set_ylim(0, 1)
        else:
            mark_no_speedup(ax)
    ax = axes[-1]
    ax.bar(range(len(names)), [float(reports[name].summary.get("U_ce", float("nan"))) for name in names],
           color=[f"C{i}" for i in range(len(names))])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_title("unfairness U (variance of K_T)", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=len(labels), fontsize=9)
    return fig


def plot_comparison(reports: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """PNG: per-task predicted and (when measured) wall-clock speed-up and acceptance α_T for each drafter side by
    side, with a line at speed-up 1, and U (CE) per drafter; one legend above the panels."""
    import matplotlib.pyplot as plt

    fig = comparison_figure(reports)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return Path(path)


def _speed_sentence(settings: DemoSettings, cost: CostRatio, info: Mapping[str, Any],
                    reports: Mapping[str, Any]) -> str:
    parameter_ratio = info["drafter_parameters"] / info["verifier_parameters"]
    text = f"\"S predicted\" is S(α_T, K, c) with the {cost_ratio_line(cost.summary())}"
    text += ", from the command line (--cost-ratio). " if cost.source == "given" else ". "
    text += (f"The drafter/verifier parameter ratio, {parameter_ratio:.3g}, is what c would be where a step costs in "
             "proportion to the weights it reads (a GPU at small batch); models this small are overhead-bound on a "
             "CPU, so c is closer to 1 here. ")
    if settings.wall_clock:
        measured = [row.speedup_measured for report in reports.values() for row in report.tasks
                    if row.speedup_measured is not None]
        text += ("\"S measured\" is the generation rate (tokens per second) of `specdec.generate` over that of the "
                 "verifier's own `generate` on each task's held-out prompts, both with at most "
                 f"{settings.max_new_tokens} new tokens per prompt and the tokenizer's eos, median of "
                 f"{settings.wall_clock_repeats} timed repetitions after a warm-up")
        if measured:
            text += f" (from {min(measured):.3g} to {max(measured):.3g} over all tasks and drafters)"
        text += "; below 1, speculative decoding was slower than plain decoding. "
    else:
        text += "The wall-clock speed-up was not measured (--no-wall-clock). "
    return text + "Tokens per verifier call (tok/call) are measured."


def report_markdown(pair: DemoPair, settings: DemoSettings, cost: CostRatio, samples: Mapping[str, Any],
                    reports: Mapping[str, Any], comparison: list[dict[str, Any]], plot_paths: list[Path],
                    timings: Mapping[str, float]) -> str:
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
        f"- K = {settings.num_draft_tokens} drafts per round, temperature {settings.temperature}, "
        f"cost ratio {cost_ratio_line(cost.summary(), short=True)}; {settings.num_eval_examples} held-out prompts "
        "and texts per task.",
        f"- {_speed_sentence(settings, cost, info, reports)}",
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
        f"One prompt per task; tok/call is the tokens per verifier call over the task's first "
        f"{settings.num_samples_per_task} prompts.",
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
