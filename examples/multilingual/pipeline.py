"""Command line of the multilingual experiment: one stage per command, or all of them in one.

    python examples/multilingual/run.py all --data ../shared/data --work .gpu_data/multilingual \\
        --results benchmarks/results/multilingual

Stages (README.md says what each reads and writes and how long it takes):

* ``prepare``: training corpus and shared BPE tokenizer from ``--data`` (CPU);
* ``train``: the verifier (balanced by default) and the drafters on their language mixes, from scratch;
* ``evaluate``: every pair on the MGSM languages before finetuning (the ``none`` variant);
* ``finetune``: every pair finetuned with every variant, each then evaluated (runs under torchrun);
* ``domains``: a second notion of task, math chain-of-thought against news within a language;
* ``ddp-compare``: drafters finetuned by one process against the same run under torchrun;
* ``report``: the markdown report and the figures from the rows;
* ``all``: prepare, train, finetune (languages), domains and report in one process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

STAGES = ("prepare", "train", "evaluate", "finetune", "domains", "ddp-compare", "report", "all")
DISTRIBUTED_STAGES = ("evaluate", "finetune", "domains")
DEFAULT_WORK = ".gpu_data/multilingual"


def _names(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def build_parser() -> argparse.ArgumentParser:
    from .config import PRESETS

    parser = argparse.ArgumentParser(prog="run.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("stage", choices=STAGES, help="the stage to run")
    parser.add_argument("--data", default=None, help="the shared data folder (mcot_msvamp/, ntrex128/, gsm8k/); "
                        "prepare and all need it")
    parser.add_argument("--work", default=DEFAULT_WORK, help=f"models, corpus, tokenizer and settings (default "
                        f"{DEFAULT_WORK}, which git ignores: carry it to a device run)")
    parser.add_argument("--results", default=None, help="JSON rows, report and figures (default <work>/results)")
    parser.add_argument("--preset", default="full", choices=sorted(PRESETS),
                        help="settings for prepare/all: full (one GPU), large (a 283M verifier whose drafters cost "
                        "c <= 0.15 of it; one GPU), smoke (tiny, CPU) or smollm2 (the pretrained SmolLM2-135M as "
                        "verifier; README.md); default full")
    parser.add_argument("--config", default=None, help="a config.json to start from instead of --preset "
                        "(prepare/all); later stages read <work>/config.json")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting (JSON value), e.g. --set finetune_steps=100; repeatable")
    parser.add_argument("--models", default=None, help="train: comma-separated models to train (default all)")
    parser.add_argument("--export", default=None, help="train: also copy every model file here as soon as it is "
                        "written (e.g. $OUT on a device run)")
    parser.add_argument("--pairs", default=None, help="evaluate/finetune: comma-separated drafters (default all); "
                        "domains: one drafter (default domain_pair, else the first)")
    parser.add_argument("--variants", default=None, help="finetune/domains: comma-separated variants (default the "
                        "config's variants / domain_variants), e.g. none,uniform_kd,scdf_kl,scdf_char_kl")
    parser.add_argument("--save-drafters", action="store_true", help="finetune: also write every finetuned drafter "
                        "(float32) to <work>/finetuned/ (for ddp-compare)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto: the GPU "
                        "when there is one")
    parser.add_argument("--no-plots", action="store_true", help="report: tables only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    import os

    from .config import CONFIG_NAME, build_config, parse_overrides
    from .report import write_report
    from .stages import (
        Context,
        init_distributed,
        resolve_device,
        stage_ddp_compare,
        stage_finetune,
        stage_prepare,
        stage_train,
    )

    parser = build_parser()
    args = parser.parse_args(argv)
    work = Path(args.work)
    results = Path(args.results) if args.results else work / "results"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.stage not in DISTRIBUTED_STAGES:
        parser.error(f"only the stages {', '.join(DISTRIBUTED_STAGES)} run under torchrun; run {args.stage} as one "
                     "process")
    try:
        overrides = parse_overrides(args.set)
    except ValueError as error:
        parser.error(str(error))
    if args.stage in ("prepare", "all"):
        if not args.data:
            parser.error(f"{args.stage} needs --data (the folder holding mcot_msvamp/, ntrex128/ and gsm8k/)")
        cfg = build_config(args.preset, args.config, overrides)
    elif args.stage == "report":
        cfg = None
    else:
        cfg = build_config(file=work / CONFIG_NAME, overrides=overrides)
    device = resolve_device(args.device)
    rank, world = init_distributed(device) if args.stage in DISTRIBUTED_STAGES else (0, 1)
    ctx = Context(cfg=cfg, work=work, results=results, device=device, progress=not args.no_progress, rank=rank,
                  world=world)
    start = time.perf_counter()
    if args.stage == "prepare":
        stage_prepare(ctx, args.data)
    elif args.stage == "train":
        stage_train(ctx, _names(args.models), args.export)
    elif args.stage == "evaluate":
        stage_finetune(ctx, _names(args.pairs), ["none"], "languages")
    elif args.stage == "finetune":
        stage_finetune(ctx, _names(args.pairs), _names(args.variants), "languages", args.save_drafters)
    elif args.stage == "domains":
        pairs = _names(args.pairs)
        if pairs and len(pairs) != 1:
            parser.error("domains takes one pair (--pairs NAME)")
        stage_finetune(ctx, pairs, _names(args.variants), "domains", args.save_drafters)
    elif args.stage == "ddp-compare":
        stage_ddp_compare(ctx)
    elif args.stage == "report":
        path = write_report(results, plots=not args.no_plots)
        print(f"report: {path}")
    else:
        stage_prepare(ctx, args.data)
        stage_train(ctx)
        stage_finetune(ctx, None, None, "languages")
        stage_finetune(ctx, None, None, "domains")
        path = write_report(results, plots=not args.no_plots)
        print(f"report: {path}")
    if rank == 0:
        print(f"stage {args.stage} took {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0
