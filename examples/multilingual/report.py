"""The report stage: the JSON rows under ``<results>/rows/`` as one markdown report with tables and matplotlib plots.

For every pair of the language experiment (and the pair of the domain experiment): one table per token and one per
character with a line per variant (mean / worst alpha, alpha std, U on K_T and D_T, predicted and measured speed-up
spreads; per character the rate ``rho_T S_T`` with its max/min, characters per verifier call, U on
``D_T / rho_T``),
per-language alpha and rate tables, the comparisons the experiment asks for (against uniform distillation, as
measured), the DDP comparison where a variant was run by one and by several processes, and two figures per pair.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.fairness.report import cost_ratio_line, format_number, markdown_table

SCDF_BASES = ("scdf_ce", "scdf_kl", "scdf_tv")


def load_rows(results: str | Path) -> list[dict[str, Any]]:
    """Every row of ``<results>/rows/*.jsonl``."""
    folder = Path(results) / "rows"
    if not folder.is_dir():
        raise FileNotFoundError(f"no rows in {folder}: run the other stages first")
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        with path.open(encoding="utf-8") as handle:
            rows += [json.loads(line) for line in handle if line.strip()]
    return rows


def runs_by_time(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """(experiment, pair, variant, world) -> time -> {"summary": row, "tasks": [rows]}: every run that wrote its
    summary row."""
    groups: dict[tuple, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.get("kind") in ("task", "summary"):
            key = (row["experiment"], row["pair"], row["variant"], row.get("world_size", 1))
            groups[key][row["time"]].append(row)
    out: dict[tuple, dict[str, dict[str, Any]]] = {}
    for key, by_time in groups.items():
        for time, run_rows in by_time.items():
            summaries = [r for r in run_rows if r["kind"] == "summary"]
            if summaries:
                out.setdefault(key, {})[time] = {"summary": summaries[-1],
                                                 "tasks": [r for r in run_rows if r["kind"] == "task"]}
    return out


def latest_runs(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(experiment, pair, variant, world) -> {"summary": row, "tasks": [rows]} of the latest run of each."""
    return {key: by_time[max(by_time)] for key, by_time in runs_by_time(rows).items()}


def repeated_runs(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """Per (experiment, pair, world), the runs of a variant repeated with the same settings, the latest against each
    earlier one: how many comparisons, and the largest |Δ| over them of α_T (any task), mean α, α std, mean α in
    generation and U on K_T (nan where no run has the figure)."""
    names = ("alpha_mean", "alpha_std", "alpha_measured_mean", "U_ce")

    def difference(a: float | None, b: float | None) -> float:
        return math.nan if a is None or b is None else abs(a - b)

    found: dict[tuple, list[list[float]]] = defaultdict(list)
    for (experiment, pair, _variant, world), by_time in sorted(runs_by_time(rows).items()):
        latest = by_time[max(by_time)]
        alphas = {r["task"]: r.get("alpha") for r in latest["tasks"]}
        for time in sorted(by_time)[:-1]:
            earlier = by_time[time]
            deltas = [difference(alphas.get(r["task"]), r.get("alpha")) for r in earlier["tasks"]]
            found[experiment, pair, world].append(
                [_largest(deltas)] + [difference(latest["summary"].get(n), earlier["summary"].get(n)) for n in names])
    return [[*key, len(diffs), *(_largest(column) for column in zip(*diffs, strict=True))]
            for key, diffs in found.items()]


def _largest(values: Any) -> float:
    """The largest value that is not nan (nan when there is none)."""
    return max((v for v in values if not math.isnan(v)), default=math.nan)


def _get(row: dict[str, Any] | None, key: str) -> Any:
    return None if row is None else row.get(key)


def _ratio_gap(value: float | None) -> float | None:
    return None if value is None else value - 1.0


def _order(variants: Sequence[str]) -> list[str]:
    """Baselines first, then per-token s-CDF, its variants mixed with the natural mixture (``_mix<P>``), then the
    per-character variants, unmixed and mixed (each group in the given order)."""
    preferred = ["none", "uniform_kd", "balanced", "exact_variance"]
    rest = [v for v in variants if v not in preferred]
    groups = [[v for v in rest if ("_char" in v) == char and ("_mix" in v) == mix]
              for char in (False, True) for mix in (False, True)]
    return [v for v in preferred if v in variants] + [v for group in groups for v in group]


def _pair_tables(runs: dict[str, dict[str, Any]], dominant: str | None) -> list[str]:
    variants = _order(list(runs))
    uniform = _get(runs.get("uniform_kd"), "summary")
    # the rounds-only speed-up exists in rows timed with their calls split at the first token
    split = any(runs[v]["summary"].get("speedup_measured_decode_mean") is not None for v in variants)
    lines = ["Per token:", ""]
    headers = ["variant", "mean α", "worst α (task)", "α std", "α gen mean", "U on K_T", "U on D_T", "U on TV_T",
               "S pred mean", "S pred max/min", "S measured mean", "S measured std", "S measured max/min",
               *(["S measured after the first token mean"] if split else []), "Spearman(fitness, S pred)",
               "Spearman(fitness, S measured)"]
    if dominant:
        headers += [f"{dominant} α", f"{dominant} α − uniform KD (points)"]
    headers += ["greedy identical", "finetune s", "eval s"]
    table = []
    for v in variants:
        s = runs[v]["summary"]
        worst = f"{format_number(s.get('alpha_min'))} ({s.get('worst_task', '–')})"
        row = [v, s.get("alpha_mean"), worst, s.get("alpha_std"), s.get("alpha_measured_mean"), s.get("U_ce"),
               s.get("U_kl"), s.get("U_tv"), s.get("speedup_predicted_mean"), s.get("speedup_predicted_max_over_min"),
               s.get("speedup_measured_mean"), s.get("speedup_measured_std"), s.get("speedup_measured_max_over_min"),
               *([s.get("speedup_measured_decode_mean")] if split else []),
               s.get("spearman_fitness_speedup_predicted"), s.get("spearman_fitness_speedup_measured")]
        if dominant:
            base = _get(uniform, "dominant_alpha")
            here = s.get("dominant_alpha")
            row += [here, None if base is None or here is None else 100 * (here - base)]
        row += [{True: "yes", False: "NO"}.get(s.get("verifier_greedy_identical"), "–"), s.get("finetune_seconds"),
                s.get("eval_seconds")]
        table.append(row)
    lines += markdown_table(headers, table)
    lines += ["", "Per character (ρ_T = characters per text token, rate = ρ_T·S(α_T): characters per verifier-step "
              "time relative to one token per verifier call):", ""]
    headers = ["variant", "rate mean", "worst rate (task)", "rate max/min", "chars/call mean", "chars/call max/min",
               "rate from generation max/min", "rate measured max/min", "U on D_T/ρ_T", "Spearman(fitness, rate)",
               "Spearman(data share, rate)"]
    table = []
    for v in variants:
        s = runs[v]["summary"]
        worst = f"{format_number(s.get('char_speedup_predicted_min'))} ({s.get('worst_char_rate_task', '–')})"
        table.append([v, s.get("char_speedup_predicted_mean"), worst, s.get("char_speedup_predicted_max_over_min"),
                      s.get("chars_per_call_mean"), s.get("chars_per_call_max_over_min"),
                      s.get("char_rate_generation_max_over_min"), s.get("char_rate_measured_max_over_min"),
                      s.get("U_kl_per_char"), s.get("spearman_fitness_char_rate"), s.get("spearman_share_char_rate")])
    lines += markdown_table(headers, table)
    tasks = [r["task"] for r in runs[variants[0]]["tasks"]]
    for key, title in (("alpha", "α_T per task (teacher-forced)"), ("alpha_measured", "α per task (generation)"),
                       ("char_speedup_predicted", "ρ_T·S(α_T) per task"),
                       ("speedup_measured", "S measured per task"),
                       ("speedup_measured_decode", "S measured after the first token (the rounds alone) per task")):
        if not any(r.get(key) is not None for run in runs.values() for r in run["tasks"]):
            continue
        lines += ["", f"{title}:", ""]
        table = []
        for v in variants:
            by_task = {r["task"]: r.get(key) for r in runs[v]["tasks"]}
            table.append([v] + [by_task.get(t) for t in tasks])
        lines += markdown_table(["variant"] + tasks, table)
    return lines


def comparisons(runs: dict[str, dict[str, Any]], dominant: str | None) -> list[dict[str, Any]]:
    """The measured figures behind the experiment's goals, each against uniform distillation (no verdict on the
    method: the figures as they came out)."""
    uniform = _get(runs.get("uniform_kd"), "summary")
    if uniform is None:
        return []
    out = []
    scdf = [v for v in SCDF_BASES if v in runs and runs[v]["summary"].get("alpha_std") is not None]
    if scdf and uniform.get("alpha_std"):
        best = min(scdf, key=lambda v: runs[v]["summary"]["alpha_std"])
        s = runs[best]["summary"]
        narrowing = 1 - s["alpha_std"] / uniform["alpha_std"]
        mean_diff = s["alpha_mean"] - uniform["alpha_mean"]
        out.append({"goal": "s-CDF (best basis) narrows the per-token α spread by ≥ 25% at a mean α within 0.01",
                    "variant": best, "figure": f"α std {s['alpha_std']:.4g} vs {uniform['alpha_std']:.4g} "
                    f"(narrowed {100 * narrowing:.1f}%), mean α {mean_diff:+.4f}",
                    "met": narrowing >= 0.25 and abs(mean_diff) <= 0.01})
    for v, run in runs.items():
        s = run["summary"]
        if not s.get("per_character"):
            continue
        here, base = s.get("char_speedup_predicted_max_over_min"), uniform.get("char_speedup_predicted_max_over_min")
        if here is None or base is None:
            continue
        gap_here, gap_base = _ratio_gap(here), _ratio_gap(base)
        narrowing = 1 - gap_here / gap_base if gap_base else None
        mean_diff = s["char_speedup_predicted_mean"] - uniform["char_speedup_predicted_mean"]
        out.append({"goal": "the per-character variant narrows the rate max/min by ≥ 25% at no lower mean rate",
                    "variant": v, "figure": f"max/min {here:.4g} vs {base:.4g} (gap max/min − 1 narrowed "
                    f"{'–' if narrowing is None else f'{100 * narrowing:.1f}%'}), mean rate {mean_diff:+.4g}",
                    "met": narrowing is not None and narrowing >= 0.25 and mean_diff >= 0})
    if dominant and uniform.get("dominant_alpha") is not None:
        for v in _order(list(runs)):
            s = runs[v]["summary"]
            if v in ("none", "uniform_kd") or s.get("dominant_alpha") is None:
                continue
            diff = 100 * (s["dominant_alpha"] - uniform["dominant_alpha"])
            out.append({"goal": f"the dominant language ({dominant}) stays within 1 point of its uniform-KD α",
                        "variant": v, "figure": f"{diff:+.2f} points", "met": abs(diff) <= 1.0})
    return out


def _ddp_lines(all_runs: dict[tuple, dict[str, Any]], ddp_rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for (experiment, pair, variant, world), run in sorted(all_runs.items()):
        if world == 1 or (experiment, pair, variant, 1) not in all_runs:
            continue
        one = {r["task"]: r for r in all_runs[experiment, pair, variant, 1]["tasks"]}
        many = {r["task"]: r for r in run["tasks"]}
        lines += ["", f"{experiment} / {pair} / {variant}: 1 process against {world} (same global batch):", ""]
        table = []
        for task in one:
            a, b = one[task], many.get(task, {})
            table.append([task, a.get("alpha"), b.get("alpha"), a.get("char_speedup_predicted"),
                          b.get("char_speedup_predicted"), a.get("cross_entropy"), b.get("cross_entropy")])
        lines += markdown_table(["task", "α (1)", f"α ({world})", "rate (1)", f"rate ({world})", "K_T (1)",
                                 f"K_T ({world})"], table)
        deltas = [abs(r[1] - r[2]) for r in table if r[1] is not None and r[2] is not None]
        if deltas:
            lines.append(f"\nlargest |Δα| over the tasks: {max(deltas):.3g}; c = "
                         f"{format_number(all_runs[experiment, pair, variant, 1]['summary'].get('cost_ratio'))} "
                         f"(1 process) and {format_number(run['summary'].get('cost_ratio'))} ({world}), each "
                         "measured in its own run, so the rates differ by their c as well")
    if ddp_rows:
        lines += ["", "Drafter weights, one process against several:", ""]
        lines += markdown_table(["experiment", "pair", "variant", "processes", "largest abs Δw", "‖Δw‖ / ‖w‖"],
                                [[r["experiment"], r["pair"], r["variant"], r["world_size"],
                                  r["max_abs_weight_difference"], r["relative_l2_weight_difference"]]
                                 for r in ddp_rows])
    return lines


def plot_pair(runs: dict[str, dict[str, Any]], title: str, path_stem: Path) -> list[Path]:
    """Grouped bars per task: α_T and ρ_T·S(α_T), one bar per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = _order(list(runs))
    tasks = [r["task"] for r in runs[variants[0]]["tasks"]]
    paths = []
    for key, label in (("alpha", "α_T (teacher-forced)"),
                       ("char_speedup_predicted", "ρ_T·S(α_T) (characters per verifier-step time)")):
        fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(tasks) * max(1, len(variants) / 4)), 4.5),
                               layout="constrained")
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            by_task = {r["task"]: r.get(key) for r in runs[v]["tasks"]}
            values = [math.nan if by_task.get(t) is None else by_task[t] for t in tasks]
            ax.bar([x - 0.4 + width * (i + 0.5) for x in range(len(tasks))], values, width, label=v)
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylabel(label)
        ax.set_title(f"{title}: {label}")
        ax.legend(fontsize=7, ncols=min(len(variants), 5), loc="upper center", bbox_to_anchor=(0.5, -0.08))
        path = path_stem.with_name(f"{path_stem.name}__{key}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def drafter_lines(runs: dict[tuple, dict[str, Any]], experiment: str, pairs: list[str]) -> list[str]:
    """Every pair of ``experiment`` as trained (variant ``none``, one process) side by side: c, the spread of α and
    of the measured speed-up across tasks (mean, std, max/min, the slowest task), then α_T and the measured speed-up
    per task, one line per drafter (the n-gram drafter beside the models)."""
    found = {pair: runs[experiment, pair, "none", 1] for pair in pairs if (experiment, pair, "none", 1) in runs}
    if not found:
        return []
    lines = ["Drafters as trained (variant none), side by side:", ""]
    split = any(run["summary"].get("speedup_measured_decode_mean") is not None for run in found.values())
    table = []
    for pair, run in found.items():
        s = run["summary"]
        measured = [r for r in run["tasks"] if r.get("speedup_measured") is not None]
        slowest = min(measured, key=lambda r: r["speedup_measured"])["task"] if measured else "–"
        table.append([pair, s.get("drafter_kind", "–"), s.get("cost_ratio"), s.get("alpha_mean"), s.get("alpha_std"),
                      s.get("alpha_max_over_min"), s.get("speedup_predicted_mean"), s.get("speedup_measured_mean"),
                      s.get("speedup_measured_std"), s.get("speedup_measured_max_over_min"),
                      f"{format_number(s.get('speedup_measured_min'))} ({slowest})", s.get("speedup_measured_max"),
                      *([s.get("speedup_measured_decode_mean")] if split else [])])
    lines += markdown_table(["drafter", "kind", "c", "mean α", "α std", "α max/min", "S pred mean", "S measured mean",
                             "S measured std", "S measured max/min", "S measured min (task)", "S measured max",
                             *(["S measured after the first token mean"] if split else [])], table)
    tasks = list(dict.fromkeys(r["task"] for run in found.values() for r in run["tasks"]))
    for key, title in (("alpha", "α_T per task"), ("speedup_measured", "S measured per task")):
        lines += ["", f"{title}, by drafter:", ""]
        table = []
        for pair, run in found.items():
            by_task = {r["task"]: r.get(key) for r in run["tasks"]}
            table.append([pair] + [by_task.get(t) for t in tasks])
        lines += markdown_table(["drafter"] + tasks, table)
    return lines


def _stopped_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The stage calls a seconds cap stopped, with what each left out."""
    stopped = [r for r in rows if r.get("kind") == "stopped"]
    if not stopped:
        return []
    lines = ["## Stopped by a seconds cap", "", "These stage calls reached `stage_max_seconds` and left work out "
             "(run it again with a larger cap, or alone):", ""]
    table = []
    for r in stopped:
        stage = " / ".join(str(r[k]) for k in ("stage", "experiment") if r.get(k))
        left_out = ", ".join("/".join(map(str, u)) if isinstance(u, list) else str(u) for u in r.get("left_out", []))
        table.append([stage, r.get("time"), r.get("stage_max_seconds"), r.get("elapsed_seconds"),
                      len(r.get("done", [])), left_out])
    lines += markdown_table(["stage", "time", "cap (s)", "elapsed (s)", "done", "left out"], table)
    return lines + [""]


def _cost_lines(pair_runs: dict[str, dict[str, Any]]) -> str:
    """The cost ratio of a pair's runs: one line, or (runs measured apart) each value with its variants."""
    lines: dict[str, list[str]] = {}
    for variant, run in pair_runs.items():
        lines.setdefault(cost_ratio_line(run["summary"], short=True), []).append(variant)
    if len(lines) == 1:
        return next(iter(lines))
    return "; ".join(f"{line} ({', '.join(variants)})" for line, variants in lines.items())


def _baseline_line(pair_runs: dict[str, dict[str, Any]]) -> str:
    """What the measured speed-ups of a pair's runs are measured against."""
    names = {"hf": "the verifier's Hugging Face generate", "specdec": "specdec.generate with no drafts (same path)"}
    baselines = {run["summary"].get("wall_clock_baseline", "hf") for run in pair_runs.values()
                 if run["summary"].get("wall_clock_measured")}
    if not baselines:
        return ""
    return "S measured: over " + " or ".join(names.get(b, str(b)) for b in sorted(baselines)) + "."


def write_report(results: str | Path, plots: bool = True) -> Path:
    """``<results>/report.md`` and ``<results>/figures/*.png`` from the rows."""
    results = Path(results)
    rows = load_rows(results)
    runs = latest_runs(rows)
    presets = sorted({r.get("preset") for r in rows if r.get("preset")})
    devices = sorted({r.get("device") for r in rows if r.get("device")})
    lines = ["# Multilingual disparity of speculative decoding: pipeline report", "",
             f"Presets: {', '.join(presets) or '–'}; devices: {', '.join(devices) or '–'}.", ""]
    if "smoke" in presets:
        lines += ["**Smoke preset: tiny models trained for a few steps. These figures exercise the pipeline and say "
                  "nothing about the methods.**", ""]
    prepare = [r for r in rows if r.get("kind") == "prepare"]
    if prepare:
        p = prepare[-1]
        origin = p.get("tokenizer") or (f"byte-level BPE trained on {p['tokenizer_chars_per_language']} characters "
                                        "of every language")
        lines += ["## Data", "", f"Tokenizer: {origin}, {p['vocab_size']} tokens. Training split (held-out split not "
                  "shown):", ""]
        table = []
        for lang, domains in p["stats"].get("train", {}).items():
            for domain, st in domains.items():
                table.append([lang, domain, st["texts"], st["chars"], st["tokens"], st["chars_per_token"]])
        lines += markdown_table(["language", "domain", "texts", "characters", "tokens", "chars/token"], table)
        dropped = p.get("dropped_as_evaluation_questions") or {}
        lines += ["", f"Training texts dropped because their question is an evaluation question: "
                  f"{dict(dropped) or 'none'}.", ""]
    trained = {}
    for r in rows:
        if r.get("kind") == "train":
            trained[r["model"]] = r
    if trained:
        langs = list(next(iter(trained.values())).get("heldout_loss", {}))
        lines += ["## Models", "", "Held-out next-token loss (nats) per language after training (the model's fit to "
                  "each language):", ""]
        table = [[name, r["arch"], r["params"], r["num_layers"], r["hidden_size"], r.get("steps_run", r["steps"]),
                  r.get("cut_by") or "–", r.get("seconds")] + [r.get("heldout_loss", {}).get(lang) for lang in langs]
                 for name, r in trained.items()]
        lines += markdown_table(["model", "arch", "parameters", "layers", "hidden", "steps run", "cut by", "seconds"]
                                + langs, table)
        lines += ["", "Training mix (share of windows per language):", ""]
        lines += markdown_table(["model"] + langs, [[name] + [r["weights"].get(lang) for lang in langs]
                                                    for name, r in trained.items()])
        lines.append("")
    figures = []
    goal_rows = []
    for experiment in ("languages", "domains"):
        pairs = list(dict.fromkeys(k[1] for k in runs if k[0] == experiment))  # in the order they were run
        if not pairs:
            continue
        lines += [f"## Experiment: {'MGSM languages' if experiment == 'languages' else 'domains (math CoT vs news)'}",
                  ""]
        for pair in pairs:
            worlds = sorted({k[3] for k in runs if k[0] == experiment and k[1] == pair})
            world = 1 if 1 in worlds else worlds[0]
            pair_runs = {k[2]: v for k, v in runs.items() if k[0] == experiment and k[1] == pair and k[3] == world}
            first = next(iter(pair_runs.values()))["summary"]
            dominant = first.get("dominant_task")
            lines += [f"### Pair: verifier + {pair}" + (f" ({world} processes)" if world != 1 else ""), "",
                      f"K = {first.get('num_draft_tokens')}, {_cost_lines(pair_runs)}, temperature "
                      f"{first.get('temperature')}, finetuning "
                      f"steps {max(r['summary'].get('finetune_steps', 0) for r in pair_runs.values())} for every "
                      f"variant. {_baseline_line(pair_runs)}", ""]
            lines += _pair_tables(pair_runs, dominant)
            found = comparisons(pair_runs, dominant)
            goal_rows += [[experiment, pair, g["goal"], g["variant"], g["figure"], "yes" if g["met"] else "no"]
                          for g in found]
            if plots:
                figures += plot_pair(pair_runs, f"{experiment} / {pair}",
                                     results / "figures" / f"{experiment}__{pair}")
            lines.append("")
        if len(pairs) > 1:
            lines += drafter_lines(runs, experiment, pairs) + [""]
    lines += _stopped_lines(rows)
    if goal_rows:
        lines += ["## Against uniform distillation (as measured)", ""]
        lines += markdown_table(["experiment", "pair", "goal", "variant", "figure", "met"], goal_rows)
        lines.append("")
    repeated = repeated_runs(rows)
    if repeated:
        lines += ["## Repeated runs", "",
                  "Variants run again with the same settings (the latest run is reported above), the latest run "
                  "against each earlier one: the largest absolute differences over the repeats.", ""]
        lines += markdown_table(["experiment", "pair", "processes", "repeats", "Δα_T (any task)", "Δ mean α",
                                 "Δ α std", "Δ α gen mean", "Δ U on K_T"], repeated)
        lines.append("")
    ddp = _ddp_lines(runs, [r for r in rows if r.get("kind") == "ddp"])
    if ddp:
        lines += ["## One process against DDP", *ddp, ""]
    if figures:
        lines += ["## Figures", ""] + [f"![{p.stem}](figures/{p.name})" for p in figures] + [""]
    path = results / "report.md"
    path.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")
    return path
