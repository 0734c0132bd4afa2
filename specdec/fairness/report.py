"""The fairness report: one :class:`TaskFairness` row per task and the :class:`FairnessReport` of
:func:`specdec.fairness.evaluate`, with its markdown, JSON and PNG renderings."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
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


def columns_with_values(columns: Sequence[tuple[str, str]], rows: Sequence[Any],
                        value: Callable[[Any, str], object] = getattr) -> list[tuple[str, str]]:
    """The ``(header, key)`` pairs of ``columns`` that some row has a value for (``value(row, key)`` not None); the
    first column (the row's name) is always kept."""
    return [column for index, column in enumerate(columns)
            if index == 0 or any(value(row, column[1]) is not None for row in rows)]


@dataclass
class TaskFairness:
    """One task's row of the report; a figure stays None when the input it needs (texts or prompts) was not given.

    Speed-ups named ``*_predicted*`` come from the cost model S = E[N] / (K c + 1); ``speedup_measured`` is timed
    (the wall clock of :func:`specdec.generate` against the verifier's own ``generate`` on the task's prompts).
    At temperature 0 the divergences are taken at T = 1 and bound no greedy speed-up: ``bound_tv`` and
    ``bound_pinsker`` stay None. ``alpha_measured`` counts accepted over tested drafts (a draft after a rejection is
    never tested, so this estimates alpha); ``acceptance_rate`` is the raw accepted / drafted counter ratio.
    """

    name: str
    # teacher-forced, from the task's texts
    num_texts: int = 0  # texts used (after max_examples, with at least 2 tokens after the cut to max_length)
    num_texts_dropped: int = 0  # texts left out for having fewer than 2 tokens
    num_tokens: int = 0  # prefixes teacher-forced (each used text's tokens less one)
    alpha: float | None = None  # alpha_T = E_s sum_x min(p, q)
    speedup_predicted: float | None = None  # S(alpha_T)
    speedup_predicted_prefix_mean: float | None = None  # E_s S(alpha(s))
    cross_entropy: float | None = None  # K_T = E H(p, q)
    kl: float | None = None  # D_T = E KL(p || q)
    tv: float | None = None  # TV_T = E TV(p, q)
    entropy: float | None = None  # H_T(p) = K_T - D_T
    r_q: float | None = None  # 1 - E q(y|s), y the observed next token
    r_p: float | None = None  # 1 - E p(y|s)
    fitness: float | None = None  # 1 - r_q
    bound_tv: float | None = None  # S(1 - TV_T)
    bound_pinsker: float | None = None  # S(max(0, 1 - sqrt(D_T / 2)))
    chars_per_token: float | None = None  # rho_T = characters / text tokens (special tokens left out)
    char_speedup_predicted: float | None = None  # rho_T S(alpha_T)
    # measured by speculative decoding of the task's prompts
    num_prompts: int = 0
    alpha_measured: float | None = None  # accepted / tested drafts
    acceptance_rate: float | None = None  # accepted / drafted
    tokens_per_call: float | None = None  # generated tokens per verifier round (the prompt pass left out)
    tokens_per_call_predicted: float | None = None  # E[N] from alpha_T
    speedup_predicted_generation: float | None = None  # tokens_per_call / (K c + 1)
    chars_per_call: float | None = None  # characters of generated text per verifier round
    char_speedup_predicted_generation: float | None = None  # rho_T speedup_predicted_generation
    # timed: wall clock of specdec.generate against the verifier's own generate on the task's prompts
    speedup_measured: float | None = None  # median over repetitions of the ratio of tokens per second
    speedup_measured_min: float | None = None  # extreme per-repetition ratios
    speedup_measured_max: float | None = None
    speculative_seconds: float | None = None  # median seconds of specdec.generate over the prompts
    plain_seconds: float | None = None  # median seconds of verifier.generate over the same prompts
    # with wall_clock_baseline "specdec": the same after each call's first token (the rounds alone, what S models)
    speedup_measured_decode: float | None = None
    first_token_seconds: float | None = None  # median seconds to the first tokens (setup and prompt pass), plain side


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
        """Per-task table, what its speed-up columns mean, the cost ratio, the cross-task summary, warnings where
        the wall clock contradicts the prediction, and any bound violations."""
        columns = [("task", "name"), ("α_T", "alpha"), ("S predicted", "speedup_predicted"),
                   ("S measured (min–max)", "speedup_measured"),
                   ("S measured after the first token", "speedup_measured_decode"), ("K_T (CE)", "cross_entropy"),
                   ("D_T (KL)", "kl"),
                   ("TV_T", "tv"), ("H_T(p)", "entropy"), ("r_q", "r_q"), ("r_p", "r_p"),
                   ("S(1−TV) bound", "bound_tv"), ("S Pinsker bound", "bound_pinsker"), ("α gen", "alpha_measured"),
                   ("tok/call", "tokens_per_call"), ("S predicted from tok/call", "speedup_predicted_generation"),
                   ("chars/call", "chars_per_call"), ("char S predicted", "char_speedup_predicted")]
        columns = columns_with_values(columns, self.tasks)
        lines = markdown_table([c[0] for c in columns], ([_cell(row, c[1]) for c in columns] for row in self.tasks))
        s = self.summary
        lines += ["", *_column_notes([c[1] for c in columns]), "", cost_ratio_line(s) + f", K = "
                  f"{s.get('num_draft_tokens')}, temperature = {s.get('temperature')}", ""]
        keys = ["U_ce", "U_kl", "U_tv", "alpha_mean", "alpha_min", "alpha_max", "alpha_max_over_min", "alpha_std",
                "speedup_predicted_mean", "speedup_predicted_min", "speedup_predicted_max",
                "speedup_predicted_max_over_min", "speedup_predicted_std", "speedup_measured_mean",
                "speedup_measured_min", "speedup_measured_max", "speedup_measured_max_over_min",
                "speedup_measured_decode_mean", "worst_task",
                "spearman_fitness_speedup_predicted", "alpha_measured_mean", "alpha_measured_min",
                "char_speedup_predicted_max_over_min", "chars_per_call_max_over_min"]
        lines += [f"- {k}: {format_number(s[k])}" for k in keys if k in s]
        lines += speed_warnings(self.tasks)
        violations = s.get("bound_violations", [])
        if violations:
            lines.append(f"- bounds checked: {len(violations)} violated")
        elif s.get("bounds_checked", False):
            lines.append("- bounds checked: all hold")
        else:
            lines.append("- bounds checked: not checked (greedy decoding, or no task with texts)")
        lines += [f"  - {v}" for v in violations]
        return "\n".join(lines) + "\n"

    def _figure(self) -> Any:
        """The matplotlib figure of :meth:`plot` (the caller closes it)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [r.name for r in self.tasks]
        x = list(range(len(names)))

        def vals(attr: str) -> list[float]:
            return [float("nan") if getattr(r, attr) is None else float(getattr(r, attr)) for r in self.tasks]

        fig, axes = plt.subplots(2, 2, figsize=(15, 9), layout="constrained")
        ax = axes[0, 0]
        ax.bar([i - 0.2 for i in x], vals("alpha"), 0.4, label="α_T (teacher-forced)")
        ax.bar([i + 0.2 for i in x], vals("alpha_measured"), 0.4, label="α (generation)")
        ax.set_title("acceptance α per task")
        ax.set_ylim(0, 1)
        ax = axes[0, 1]
        bars = [(attr, label) for attr, label in (
            ("speedup_predicted", "predicted S(α_T)"), ("bound_tv", "predicted bound S(1−TV_T)"),
            ("bound_pinsker", "predicted bound S(1−√(D_T/2))"),
            ("speedup_predicted_generation", "predicted from tok/call"),
            ("speedup_measured", "measured (wall clock)")) if any(getattr(r, attr) is not None for r in self.tasks)]
        width = 0.8 / max(len(bars), 1)
        for index, (attr, label) in enumerate(bars):
            offset = (index - (len(bars) - 1) / 2) * width
            ax.bar([i + offset for i in x], vals(attr), width, label=label)
            if attr == "speedup_measured":
                low, high, mid = vals("speedup_measured_min"), vals("speedup_measured_max"), vals(attr)
                ax.errorbar([i + offset for i in x], mid, yerr=[[m - lo for m, lo in zip(mid, low, strict=True)],
                                                                [hi - m for m, hi in zip(mid, high, strict=True)]],
                            fmt="none", ecolor="black", capsize=2, linewidth=0.8)
        mark_no_speedup(ax)
        ax.set_title(f"speed-up per task, K = {self.summary.get('num_draft_tokens')}, "
                     f"{cost_ratio_line(self.summary, short=True)}")
        ax = axes[1, 0]
        entropy, kl = vals("entropy"), vals("kl")
        ax.bar(x, entropy, 0.6, label="H_T(p)")
        ax.bar(x, kl, 0.6, bottom=entropy, label="D_T (KL)")
        ax.set_title("K_T = H_T(p) + D_T (nats)")
        for ax in (axes[0, 0], axes[0, 1], axes[1, 0]):
            ax.set_xticks(x)
            ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        ax = axes[1, 1]
        fit = vals("fitness")
        ax.scatter(fit, vals("speedup_predicted"), label="predicted S(α_T)")
        if any(r.speedup_measured is not None for r in self.tasks):
            ax.scatter(fit, vals("speedup_measured"), marker="x", label="measured (wall clock)")
        finite = [f for f in fit if not math.isnan(f)]
        middle = (min(finite) + max(finite)) / 2 if finite else 0.0
        for name, fx, sy in zip(names, fit, vals("speedup_predicted"), strict=True):
            right_half = fx > middle  # names point inward, so none runs past the panel's edge
            ax.annotate(name, (fx, sy), xytext=(-4 if right_half else 4, 4), textcoords="offset points",
                        ha="right" if right_half else "left", fontsize=8)
        ax.margins(x=0.1)
        mark_no_speedup(ax)
        rho = self.summary.get("spearman_fitness_speedup_predicted")
        ax.set_title(f"drafter fitness vs predicted speed-up (Spearman {rho:.2f})" if rho is not None
                     else "drafter fitness vs speed-up")
        ax.set_xlabel("fitness 1 − r_q")
        ax.set_ylabel("speed-up")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        return fig

    def plot(self, path: str) -> str:
        """PNG with per-task bars of alpha, speed-up (predicted, its bounds, and measured on the wall clock, with a
        line at 1 below which decoding got slower) and K_T = H_T(p) + D_T, and a scatter of drafter fitness
        (1 - r_q) against speed-up; legends sit beside the panels. Returns ``path``."""
        import matplotlib.pyplot as plt

        fig = self._figure()
        fig.savefig(path, format="png", dpi=100)
        plt.close(fig)
        return path


def mark_no_speedup(ax: Any) -> None:
    """A dashed line at speed-up 1 on ``ax``: bars below it mark a slowdown."""
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1.0, label="1 = no speed-up (below: slower)")
    low, high = ax.get_ylim()
    if high < 1.1:  # keep the line inside the panel, clear of its frame
        ax.set_ylim(low, 1.1)


def cost_ratio_line(summary: dict[str, Any], short: bool = False) -> str:
    """How the cost ratio c was obtained, from the summary keys of :meth:`specdec.fairness.CostRatio.summary`:
    ``cost ratio c = 0.1 (given)``, or measured with its path, batch, repetitions, spread and (when known) the step
    times; ``short``: only ``c = 0.1 (given)`` or ``c = 0.76 (measured)``."""
    value = format_number(summary.get("cost_ratio"))
    source = summary.get("cost_ratio_source") or "given"
    if short:
        return f"c = {value} ({source})"
    if source != "measured":
        return f"cost ratio c = {value} ({source})"
    spread = (f"p20–p80 {format_number(summary.get('cost_ratio_p20'))}–{format_number(summary.get('cost_ratio_p80'))},"
              f" min–max {format_number(summary.get('cost_ratio_min'))}–{format_number(summary.get('cost_ratio_max'))}")
    steps = ""
    if summary.get("drafter_step_s") is not None and summary.get("verifier_step_s") is not None:
        steps = (f"; one step {summary['drafter_step_s'] * 1e3:.3g} ms (drafter) / "
                 f"{summary['verifier_step_s'] * 1e3:.3g} ms (verifier)")
    return (f"cost ratio c = {value} (measured on the decoding step of specdec.generate, "
            f"{summary.get('cost_ratio_path')} path, batch {summary.get('cost_ratio_batch_size')}, median of "
            f"{summary.get('cost_ratio_repeats')} repetitions; {spread}{steps})")


def _cell(row: TaskFairness, attr: str) -> object:
    value = getattr(row, attr)
    if attr == "speedup_measured" and value is not None and row.speedup_measured_min is not None:
        return (f"{format_number(value)} ({format_number(row.speedup_measured_min)}–"
                f"{format_number(row.speedup_measured_max)})")
    return value


def _column_notes(attrs: Sequence[str]) -> list[str]:
    notes = {
        "speedup_predicted": "S predicted = S(α_T, K, c) = E[N] / (K c + 1), the cost model's speed-up from the "
                             "teacher-forced α_T",
        "speedup_measured": "S measured = tokens per second of specdec.generate / tokens per second of the "
                            "verifier's own generate, timed on the task's prompts with the same max_new_tokens and "
                            "eos (with greedy decoding both emit the same tokens: the ratio of their times; median of "
                            "the timed repetitions, min–max in brackets); below 1 speculative decoding was slower",
        "speedup_measured_decode": "S measured after the first token = the same ratio of rates over the tokens "
                                   "after each call's first one and the time after it (setup and the prompt pass "
                                   "left out: the rounds alone, what S(α_T, K, c) models; timed against "
                                   "specdec.generate with no drafts)",
        "speedup_predicted_generation": "S predicted from tok/call = measured tokens per verifier call / (K c + 1)",
        "char_speedup_predicted": "char S predicted = ρ_T·S(α_T), ρ_T the task's characters per text token (special "
                                  "tokens left out): characters per verifier-step time relative to one token per "
                                  "verifier call",
    }
    return [f"{notes[a]}." for a in attrs if a in notes]


def speed_warnings(rows: Sequence[TaskFairness]) -> list[str]:
    """Lines that name the tasks where the wall clock measured a slowdown, and those where the cost model predicted
    a speed-up above 1 that the wall clock did not show."""
    timed = [r for r in rows if r.speedup_measured is not None]
    lines = []
    slower = [r.name for r in timed if r.speedup_measured < 1.0]
    if slower:
        lines.append(f"- measured slower than plain decoding (S measured < 1) on {len(slower)} of {len(timed)} "
                     f"tasks: {', '.join(slower)}")
    contradicted = [r.name for r in timed if r.speedup_predicted is not None and r.speedup_predicted > 1.0
                    and r.speedup_measured < 1.0]
    if contradicted:
        lines.append(f"- warning: predicted faster (S predicted > 1) but measured slower on: {', '.join(contradicted)} "
                     "(the cost model leaves out per-round overheads; see S measured)")
    return lines
