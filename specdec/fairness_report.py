"""The fairness report: one :class:`TaskFairness` row per task and the :class:`FairnessReport` of
:func:`specdec.fairness.evaluate`, with its markdown, JSON and PNG renderings."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def format_number(value: object) -> str:
    """A table cell: ``–`` for a missing figure, floats to 4 significant digits (``nan`` kept), the rest as text."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a markdown table; cells go through :func:`format_number`."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(format_number(cell) for cell in row) + " |" for row in rows]
    return lines


@dataclass
class TaskFairness:
    """One task's row of the report; a figure stays None when the input it needs (texts or prompts) was not given.

    At temperature 0 the divergences are taken at T = 1 and bound no greedy speed-up: ``bound_tv`` and
    ``bound_pinsker`` stay None. ``alpha_measured`` counts accepted over tested drafts (a draft after a rejection is
    never tested, so this estimates alpha); ``acceptance_rate`` is the raw accepted / drafted counter ratio.
    """

    name: str
    # teacher-forced, from the task's texts
    num_texts: int = 0
    num_tokens: int = 0
    alpha: float | None = None  # alpha_T = E_s sum_x min(p, q)
    speedup: float | None = None  # S(alpha_T)
    speedup_prefix_mean: float | None = None  # E_s S(alpha(s))
    cross_entropy: float | None = None  # K_T = E H(p, q)
    kl: float | None = None  # D_T = E KL(p || q)
    tv: float | None = None  # TV_T = E TV(p, q)
    entropy: float | None = None  # H_T(p) = K_T - D_T
    r_q: float | None = None  # 1 - E q(y|s), y the observed next token
    r_p: float | None = None  # 1 - E p(y|s)
    fitness: float | None = None  # 1 - r_q
    bound_tv: float | None = None  # S(1 - TV_T)
    bound_pinsker: float | None = None  # S(max(0, 1 - sqrt(D_T / 2)))
    chars_per_token: float | None = None  # rho_T
    char_speedup: float | None = None  # S_T rho_T / mean rho
    # measured by speculative decoding of the task's prompts
    num_prompts: int = 0
    alpha_measured: float | None = None  # accepted / tested drafts
    acceptance_rate: float | None = None  # accepted / drafted
    tokens_per_call: float | None = None  # generated tokens per verifier call
    tokens_per_call_predicted: float | None = None  # E[N] from alpha_T
    speedup_measured: float | None = None  # tokens_per_call / (K c + 1)
    chars_per_call: float | None = None  # characters of generated text per verifier call
    char_speedup_measured: float | None = None  # speedup_measured rho_T / mean rho


@dataclass
class FairnessReport:
    """Result of :func:`evaluate`: ``tasks`` (one :class:`TaskFairness` per task), ``summary`` (cross-task figures,
    settings and ``bound_violations``)."""

    tasks: list[TaskFairness]
    summary: dict[str, Any] = field(default_factory=dict)

    def task(self, name: str) -> TaskFairness:
        for row in self.tasks:
            if row.name == name:
                return row
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict: ``{"tasks": [row dicts], "summary": {...}}``."""
        return {"tasks": [asdict(row) for row in self.tasks], "summary": dict(self.summary)}

    def to_markdown(self) -> str:
        """Per-task table, then the cross-task summary and any bound violations."""
        columns = [("task", "name"), ("α_T", "alpha"), ("S_T", "speedup"), ("K_T (CE)", "cross_entropy"),
                   ("D_T (KL)", "kl"), ("TV_T", "tv"), ("H_T(p)", "entropy"), ("r_q", "r_q"), ("r_p", "r_p"),
                   ("S(1−TV)", "bound_tv"), ("S Pinsker", "bound_pinsker"), ("α gen", "alpha_measured"),
                   ("tok/call", "tokens_per_call"), ("chars/call", "chars_per_call"),
                   ("char S_T", "char_speedup")]
        columns = [c for c in columns if c[1] == "name" or any(getattr(r, c[1]) is not None for r in self.tasks)]
        lines = markdown_table([c[0] for c in columns], ([getattr(row, c[1]) for c in columns] for row in self.tasks))
        s = self.summary
        lines += ["", f"K = {s.get('num_draft_tokens')}, cost ratio c = {format_number(s.get('cost_ratio'))} "
                  f"({'measured' if s.get('cost_ratio_measured') else 'given'}), temperature = {s.get('temperature')}",
                  ""]
        keys = ["U_ce", "U_kl", "U_tv", "alpha_mean", "alpha_min", "alpha_max", "alpha_max_over_min", "alpha_std",
                "speedup_mean", "speedup_min", "speedup_max", "speedup_max_over_min", "speedup_std", "worst_task",
                "spearman_fitness_speedup", "alpha_measured_mean", "alpha_measured_min", "char_speedup_max_over_min",
                "chars_per_call_max_over_min"]
        lines += [f"- {k}: {format_number(s[k])}" for k in keys if k in s]
        violations = s.get("bound_violations", [])
        if violations:
            lines.append(f"- bounds checked: {len(violations)} violated")
        elif s.get("bounds_checked", False):
            lines.append("- bounds checked: all hold")
        else:
            lines.append("- bounds checked: not checked (greedy decoding, or no task with texts)")
        lines += [f"  - {v}" for v in violations]
        return "\n".join(lines) + "\n"

    def plot(self, path: str) -> str:
        """PNG with per-task bars of alpha, speed-up (with its bounds) and K_T = H_T(p) + D_T, and a scatter of
        drafter fitness (1 - r_q) against speed-up. Returns ``path``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [r.name for r in self.tasks]
        x = list(range(len(names)))

        def vals(attr: str) -> list[float]:
            return [float("nan") if getattr(r, attr) is None else float(getattr(r, attr)) for r in self.tasks]

        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        ax = axes[0, 0]
        ax.bar([i - 0.2 for i in x], vals("alpha"), 0.4, label="α_T (teacher-forced)")
        ax.bar([i + 0.2 for i in x], vals("alpha_measured"), 0.4, label="α (generation)")
        ax.set_title("acceptance α per task")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax = axes[0, 1]
        for offset, attr, label in ((-0.3, "speedup", "S(α_T)"), (-0.1, "bound_tv", "S(1−TV_T)"),
                                    (0.1, "bound_pinsker", "S(1−√(D_T/2))"), (0.3, "speedup_measured", "measured")):
            ax.bar([i + offset for i in x], vals(attr), 0.2, label=label)
        ax.set_title("speed-up per task")
        ax.legend(fontsize=8)
        ax = axes[1, 0]
        entropy, kl = vals("entropy"), vals("kl")
        ax.bar(x, entropy, 0.6, label="H_T(p)")
        ax.bar(x, kl, 0.6, bottom=entropy, label="D_T (KL)")
        ax.set_title("K_T = H_T(p) + D_T (nats)")
        ax.legend(fontsize=8)
        for ax in (axes[0, 0], axes[0, 1], axes[1, 0]):
            ax.set_xticks(x)
            ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax = axes[1, 1]
        fit, spd = vals("fitness"), vals("speedup")
        ax.scatter(fit, spd)
        for name, fx, sy in zip(names, fit, spd, strict=True):
            ax.annotate(name, (fx, sy), fontsize=8)
        rho = self.summary.get("spearman_fitness_speedup")
        ax.set_title(f"drafter fitness vs speed-up (Spearman {rho:.2f})" if rho is not None
                     else "drafter fitness vs speed-up")
        ax.set_xlabel("fitness 1 − r_q")
        ax.set_ylabel("S_T")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
        plt.close(fig)
        return path
