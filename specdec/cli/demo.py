"""The offline demo: a built-in verifier/drafter pair, its per-task disparity, and s-CDF closing the gap.

:func:`run_demo` (``specdec demo`` on the command line) does, on the CPU and without downloading anything:

1. trains a small Llama-family *verifier* on every task of the built-in suite (:mod:`specdec.data`) in equal
   measure, and a smaller *drafter* on a skewed mixture in which ``reverse`` and ``grammar_cyrillic`` are rare, so the
   drafter is under-fit exactly there; both are cached (``save_pretrained`` plus the tokenizer) under the user's cache
   directory, keyed by a hash of the training configuration, so a second run starts at once;
2. measures the cost ratio c on this machine (:func:`specdec.fairness.measure_decode_costs`), runs
   :func:`specdec.generate` on a few prompts of every task and :func:`specdec.fairness.evaluate` on held-out prompts
   and texts, and prints the fairness table (acceptance, predicted and measured wall-clock speed-up, cross-entropy
   per task; U);
3. finetunes a copy of the drafter with s-CDF (:func:`specdec.finetune_drafter`, verifier frozen), prints
   the table after it and, optionally, the baselines (uniform distillation, data balancing, exact-variance weights);
4. writes ``report.md``, ``report.json`` and PNG plots to the output folder the user chose (never into the source
   tree or the installed package).

The pair (configuration, training, cache) is in :mod:`specdec.cli.demo_pair` and the tables, report and plots in
:mod:`specdec.cli.demo_report`; the names the command line and users need are importable from here.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdec import data
from specdec.cli.demo_pair import (
    PAIR_META_NAME,
    DemoError,
    DemoPair,
    DemoSettings,
    check_cache_dir,
    check_writable_folder,
    default_cache_dir,
    default_pair_config,
    default_settings,
    get_demo_pair,
    load_pair,
    protected_dirs,
)
from specdec.cli.demo_report import compact_table, comparison_markdown, headline, plot_comparison, report_markdown
from specdec.fairness.report import cost_ratio_line

__all__ = [
    "BASELINE_METHODS",
    "DEFAULT_OUTPUT_DIR",
    "PAIR_META_NAME",
    "DemoError",
    "DemoPair",
    "DemoResult",
    "DemoSettings",
    "compact_table",
    "comparison_markdown",
    "default_cache_dir",
    "default_pair_config",
    "default_settings",
    "generate_samples",
    "get_demo_pair",
    "load_pair",
    "plot_comparison",
    "protected_dirs",
    "resolve_output_dir",
    "run_demo",
]

DEFAULT_OUTPUT_DIR = "specdec-demo-report"
BASELINE_METHODS = ("uniform_kd", "balanced", "exact_variance")


def resolve_output_dir(output_dir: str | os.PathLike | None, cache_dir: Path) -> tuple[Path, str | None]:
    """The folder the report goes to, and a note when the default had to be moved.

    An explicit ``output_dir`` inside the source tree or the installed package is refused (:class:`DemoError`).
    The default ``./specdec-demo-report`` is moved to ``<cache>/specdec-demo-report`` when the current folder is
    inside the source tree (for example when the demo is started from a clone of the repository).
    """
    explicit = output_dir is not None
    target = Path(output_dir if explicit else DEFAULT_OUTPUT_DIR).expanduser().resolve()
    for folder in protected_dirs():
        if target.is_relative_to(folder):
            if explicit:
                raise DemoError(f"refusing to write the demo report into the specdec source tree or package "
                                f"({target} is inside {folder}); choose a folder elsewhere with --output-dir")
            moved = (cache_dir / DEFAULT_OUTPUT_DIR).resolve()
            return moved, (f"the current folder is inside the specdec source tree ({folder}); writing the report to "
                           f"{moved} instead (choose another with --output-dir)")
    return target, None


@contextlib.contextmanager
def _transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' own progress bars (weights loading / saving) off inside the block unless ``enabled``."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


@dataclass
class DemoResult:
    """What :func:`run_demo` measured and wrote.

    ``before``/``after``: fairness reports of the original and the s-CDF drafter; ``baselines``: method name →
    report of the drafter finetuned with that baseline; ``comparison``: one row of headline figures per drafter;
    ``samples``: per task, a prompt, the greedy speculative output and its tokens per verifier call;
    ``cache_hit``: the pair came from the cache (no training); ``cost_ratio``: the
    :class:`specdec.fairness.CostRatio` every report used (measured or given).
    """

    before: Any
    after: Any
    baselines: dict[str, Any]
    comparison: list[dict[str, Any]]
    samples: dict[str, dict[str, Any]]
    cache_hit: bool
    pair_dir: Path
    output_dir: Path
    report_path: Path
    plot_paths: list[Path]
    timings: dict[str, float]
    pair_info: dict[str, Any]
    cost_ratio: Any = None


def generate_samples(pair: DemoPair, suite: Mapping[str, list[data.Example]], settings: DemoSettings, seed: int,
                     progress: bool = True) -> dict[str, dict[str, Any]]:
    """Run :func:`specdec.generate` (greedy) on the first prompts of every task; one decoded sample per task."""
    from tqdm.auto import tqdm

    from specdec.decoding.generation import generate

    tokenizer = pair.tokenizer
    samples: dict[str, dict[str, Any]] = {}
    for task, examples in tqdm(suite.items(), desc="specdec.generate per task", disable=not progress):
        prompts = [ex.prompt for ex in examples[: settings.num_samples_per_task]]
        batch = tokenizer(prompts, add_special_tokens=True, padding=True, return_tensors="pt")
        out = generate(pair.verifier, pair.drafter, batch["input_ids"], batch["attention_mask"],
                       max_new_tokens=settings.max_new_tokens, num_draft_tokens=settings.num_draft_tokens,
                       temperature=0.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       seed=seed)
        width = batch["input_ids"].shape[1]
        stats = out.stats
        first_new = out.sequences[0, width: width + int(stats.generated[0])].tolist()
        samples[task] = {
            "prompt": prompts[0],
            "output": tokenizer.decode(first_new, skip_special_tokens=True),
            "expected": examples[0].continuation,
            "tokens_per_verifier_call": float(stats.total_tokens_per_verifier_call),
            "acceptance_rate": float(stats.total_acceptance_rate),
        }
    return samples


def run_demo(
    output_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    quick: bool = False,
    seed: int = 0,
    baselines: bool = False,
    retrain: bool = False,
    finetune_steps: int | None = None,
    cost_ratio: float | None = None,
    wall_clock: bool = True,
    progress: bool = True,
    echo: Callable[[str], None] | None = print,
) -> DemoResult:
    """Train (or load) the demo pair, measure its disparity, repair it with s-CDF, and write the report.

    Args:
        output_dir: folder for ``report.md``, ``report.json`` and the PNG plots (default ``./specdec-demo-report``;
            see :func:`resolve_output_dir` for the source-tree rule).
        cache_dir: where the trained pair is cached (default :func:`default_cache_dir`).
        quick: tiny models and a few steps, for tests only (the numbers are meaningless).
        seed: seeds training, the task suite, generation and finetuning.
        baselines: also finetune with uniform distillation, data balancing and exact-variance weights.
        retrain: ignore a cached pair and train again.
        finetune_steps: s-CDF (and baseline) steps; default 150 (2 in quick mode).
        cost_ratio: c = t_drafter / t_verifier for the predicted speed-ups; default: measured on this machine, once,
            on the decoding step of :func:`specdec.generate` (:func:`specdec.fairness.measure_decode_costs`), and
            used for every drafter of the run.
        wall_clock: measure each task's wall-clock speed-up of :func:`specdec.generate` over the verifier's own
            ``generate`` for every drafter (about 10 s per drafter with one CPU thread).
        progress: tqdm bars. echo: where the printed story goes (None: silent).

    Returns:
        :class:`DemoResult`.
    """
    from specdec.fairness import CostRatio, evaluate
    from specdec.fairness.speed import resolve_cost_ratio
    from specdec.training.finetune import FinetuneConfig, finetune_drafter

    say = echo or (lambda _text: None)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    cache_root = check_cache_dir(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    out_dir, note = resolve_output_dir(output_dir, cache_root)
    check_writable_folder(out_dir, "--output-dir")  # before minutes of training, not after
    if note:
        say(f"note: {note}")
    settings = default_settings(quick)
    if finetune_steps is not None:
        if finetune_steps < 1:
            raise DemoError(f"finetune_steps must be >= 1, got {finetune_steps}")
        settings = DemoSettings(**{**asdict(settings), "finetune_steps": finetune_steps})
    try:
        given = None if cost_ratio is None else CostRatio(value=cost_ratio, source="given")
    except (TypeError, ValueError) as error:
        raise DemoError(str(error)) from None
    if not isinstance(wall_clock, bool):
        raise DemoError(f"wall_clock must be True or False, got {wall_clock!r}")
    if not wall_clock:
        settings = DemoSettings(**{**asdict(settings), "wall_clock": False})

    config = default_pair_config(seed=seed, quick=quick)
    with _transformers_progress_bars(progress):  # its own bars when it loads and saves weights
        pair = get_demo_pair(cache_root, config=config, retrain=retrain, progress=progress)
    timings["pair_seconds"] = time.perf_counter() - started
    info = pair.info
    say(f"demo pair: verifier {info['verifier_parameters']:,} parameters, drafter {info['drafter_parameters']:,} "
        f"parameters ({'loaded from cache' if pair.cache_hit else 'trained now'}: {pair.path})")
    step_started = time.perf_counter()
    cost = resolve_cost_ratio(given, pair.verifier, pair.drafter, batch_size=settings.batch_size,
                              max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, seed=seed)
    if given is None:
        timings["cost_ratio_seconds"] = time.perf_counter() - step_started
    say(cost.describe())

    eval_suite = data.synthetic_task_suite(settings.num_eval_examples, seed=seed, split="eval")
    step_started = time.perf_counter()
    samples = generate_samples(pair, eval_suite, settings, seed, progress)
    timings["samples_seconds"] = time.perf_counter() - step_started
    say(f"\nGreedy speculative decoding, one prompt per task (tokens per verifier call over the task's first "
        f"{settings.num_samples_per_task} prompts):")
    for task, sample in samples.items():
        say(f"  {task:17s} {sample['tokens_per_verifier_call']:.2f} tok/call  "
            f"{sample['prompt']!r} -> {sample['output']!r}")

    eval_tasks = data.suite_to_task_data(eval_suite)
    evaluation = {
        "tokenizer": pair.tokenizer, "num_draft_tokens": settings.num_draft_tokens,
        "temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens,
        "batch_size": settings.batch_size, "cost_ratio": cost, "seed": seed, "progress": progress,
        "eos_token_id": pair.tokenizer.eos_token_id, "add_special_tokens": True, "wall_clock": settings.wall_clock,
        "wall_clock_repeats": settings.wall_clock_repeats,
    }
    step_started = time.perf_counter()
    before = evaluate(pair.verifier, pair.drafter, eval_tasks, **evaluation)
    timings["evaluate_before_seconds"] = time.perf_counter() - step_started
    say("\nFairness of the original drafter (teacher-forced α_T, predicted S, K_T on held-out texts; α gen and "
        "tok/call from real generate runs" + ("; S measured: wall clock against plain decoding" if settings.wall_clock
                                              else "") + "):\n")
    say(compact_table(before))

    train_texts = {task: [ex.text for ex in examples] for task, examples in data.synthetic_task_suite(
        settings.num_finetune_examples, seed=seed, split="finetune").items()}
    held_out_texts = {task: [ex.text for ex in examples] for task, examples in eval_suite.items()}

    def finetuned(method: str) -> tuple[Any, Any]:
        drafter = copy.deepcopy(pair.drafter)
        config = FinetuneConfig(method=method, weight_basis="ce", steps=settings.finetune_steps,
                                batch_size_per_task=settings.finetune_batch_size_per_task,
                                seq_len=settings.finetune_seq_len, lr=settings.finetune_lr, eval_every=None, seed=seed)
        result = finetune_drafter(drafter, pair.verifier, train_texts, config=config, tokenizer=pair.tokenizer,
                                  progress=progress, eval_tasks=held_out_texts, add_special_tokens=True,
                                  pad_token_id=pair.tokenizer.pad_token_id)
        drafter.eval()
        return result, evaluate(pair.verifier, drafter, eval_tasks, **evaluation)

    step_started = time.perf_counter()
    say(f"\nFinetuning the drafter with s-CDF ({settings.finetune_steps} steps, corrective weights on CE; "
        "the verifier is frozen) ...")
    _, after = finetuned("scdf")
    timings["scdf_seconds"] = time.perf_counter() - step_started
    say("\nFairness after s-CDF:\n")
    say(compact_table(after))

    baseline_reports: dict[str, Any] = {}
    if baselines:
        for method in BASELINE_METHODS:
            step_started = time.perf_counter()
            say(f"\nBaseline: {method} ({settings.finetune_steps} steps) ...")
            baseline_reports[method] = finetuned(method)[1]
            timings[f"{method}_seconds"] = time.perf_counter() - step_started

    else:
        say("\n(run with --baselines to compare s-CDF with uniform distillation, data balancing and "
            "exact-variance weights)")

    reports = {"original": before, "s-CDF": after, **baseline_reports}
    comparison = [headline(name, report) for name, report in reports.items()]
    say("\nSummary (U = variance of the per-task cross-entropies K_T; S predicted with "
        f"K = {settings.num_draft_tokens}, {cost_ratio_line(cost.summary(), short=True)}"
        + ("; S measured on the wall clock" if settings.wall_clock else "") + "):\n")
    say(comparison_markdown(comparison))

    out_dir.mkdir(parents=True, exist_ok=True)
    plot_paths = [
        plot_comparison(reports, out_dir / "speedup_by_task.png"),
        Path(before.plot(str(out_dir / "fairness_before.png"))),
        Path(after.plot(str(out_dir / "fairness_after_scdf.png"))),
    ]
    timings["total_seconds"] = time.perf_counter() - started
    report_path = out_dir / "report.md"
    report_path.write_text(report_markdown(pair, settings, cost, samples, reports, comparison, plot_paths,
                                            timings), encoding="utf-8")
    (out_dir / "report.json").write_text(json.dumps({
        "pair": pair.info, "settings": asdict(settings), **cost.summary(),
        "parameter_ratio": info["drafter_parameters"] / info["verifier_parameters"], "samples": samples,
        "reports": {name: report.to_dict() for name, report in reports.items()}, "comparison": comparison,
        "timings": timings, "cache_hit": pair.cache_hit,
    }, indent=2, default=str), encoding="utf-8")
    say(f"\nReport: {report_path}\nPlots:  {', '.join(str(p) for p in plot_paths)}")
    say(f"Try the pair yourself: specdec generate --verifier {pair.path / 'verifier'} --drafter "
        f"{pair.path / 'drafter'} --prompt 'count 41:'")
    return DemoResult(before=before, after=after, baselines=baseline_reports, comparison=comparison, samples=samples,
                      cache_hit=pair.cache_hit, pair_dir=pair.path, output_dir=out_dir, report_path=report_path,
                      plot_paths=plot_paths, timings=timings, pair_info=pair.info, cost_ratio=cost)
