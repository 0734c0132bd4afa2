"""``specdec bench``: the kernel microbenchmarks of a source checkout (CUDA GPU), or a CPU smoke run of the references.

The benchmark scripts live in the repository's ``benchmarks/`` folder, which is not installed with the package: from
an editable install (``pip install -e .``) they are found next to the package, otherwise ``--benchmarks-dir`` points
at them. Without either, the command says what it needs and exits with status 2.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCHMARKS = {"rejection": "bench_rejection.py", "divergence": "bench_divergence.py"}
CHECKOUT_COMMAND = 'pip install -e ".[bench]" && specdec bench'
NEEDS_CHECKOUT = (
    "the kernel benchmarks are not part of the installed package: they need a source checkout of the specdec "
    "repository and a CUDA GPU. In the checkout, on the GPU machine, run: " + CHECKOUT_COMMAND + " (or pass "
    "--benchmarks-dir with the checkout's benchmarks/ folder; `specdec bench --cpu-smoke` runs here, without a GPU)"
)


def add_bench_parser(commands: Any, existing_path: Callable[[str], Path]) -> argparse.ArgumentParser:
    """The ``bench`` subcommand's parser, added to ``commands`` (argparse subparsers)."""
    bench = commands.add_parser(
        "bench", help="run the kernel microbenchmarks (source checkout, CUDA GPU)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run benchmarks/bench_rejection.py and benchmarks/bench_divergence.py of a source checkout of "
                    "specdec on a CUDA GPU. Arguments after -- are passed to the scripts.",
        epilog="examples:\n  specdec bench --quick\n  specdec bench divergence -- --no-fused\n"
               "  specdec bench --cpu-smoke     (no GPU: time the torch references on small shapes)\n\n"
               "The benchmarks are not installed with the package: in a checkout, run\n  " + CHECKOUT_COMMAND)
    bench.add_argument("which", nargs="?", default="all", choices=("all", *BENCHMARKS),
                       help="the benchmark to run (default: all)")
    bench.add_argument("--quick", action="store_true", help="pass --quick to the scripts (one shape each)")
    bench.add_argument("--cpu-smoke", action="store_true", help="a quick CPU run of the torch references instead")
    bench.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    bench.add_argument("--benchmarks-dir", type=existing_path, default=None,
                       help="the benchmarks/ folder of a source checkout (default: the checkout this package is "
                            "installed from, if any)")
    bench.set_defaults(handler=command_bench, script_args=[])
    return bench


def benchmarks_dir(explicit: Path | None) -> Path:
    """``explicit``, else the ``benchmarks/`` folder of the checkout the package runs from; UsageError without one."""
    from specdec._paths import source_checkout
    from specdec.cli.loading import UsageError

    if explicit is not None:
        return explicit
    checkout = source_checkout()
    if checkout is not None and (checkout / "benchmarks").is_dir():
        return checkout / "benchmarks"
    raise UsageError(NEEDS_CHECKOUT)


def _median_ms(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median wall time of ``fn()`` in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cpu_smoke(quick_shapes: Sequence[tuple[int, int]] = ((64, 1024), (256, 4096))) -> None:
    """Time the torch reference of each fused op on small CPU shapes (a smoke run, not a kernel benchmark)."""
    import torch

    from specdec.decoding.sampling import rejection_sample
    from specdec.fairness.divergences import divergence

    generator = torch.Generator().manual_seed(0)
    print("CPU smoke run of the torch references (no Triton kernels are timed):")
    print("| op | rows | vocab | median ms |\n|---|---|---|---|")
    for rows, vocab in quick_shapes:
        verifier_logits = torch.randn(rows, vocab, generator=generator)
        drafter_logits = verifier_logits + 0.7 * torch.randn(rows, vocab, generator=generator)
        ms = _median_ms(lambda v=verifier_logits, d=drafter_logits: divergence(v, d, backend="torch"))
        print(f"| divergence | {rows} | {vocab} | {ms:.3f} |")
        batch, drafts = max(rows // 8, 1), 4
        target = torch.randn(batch, drafts + 1, vocab, generator=generator)
        draft = target[:, :drafts] + 0.7 * torch.randn(batch, drafts, vocab, generator=generator)
        tokens = torch.distributions.Categorical(logits=draft).sample()
        ms = _median_ms(lambda t=target, d=draft, x=tokens: rejection_sample(t, d, x, generator=generator,
                                                                              backend="torch"))
        print(f"| rejection_sample (B={batch}, K={drafts}) | {batch * drafts} | {vocab} | {ms:.3f} |")


def command_bench(args: argparse.Namespace) -> int:
    """Run the kernel microbenchmarks (GPU) as subprocesses, or a CPU smoke run of the references."""
    import torch

    from specdec.cli.loading import CommandError, UsageError

    if args.cpu_smoke:
        if args.which != "all" or args.quick or args.dry_run or args.script_args:
            raise UsageError("argument --cpu-smoke: takes no benchmark name, --quick, --dry-run or arguments after "
                             "-- (it times the torch references on fixed small shapes)")
        cpu_smoke()
        return 0
    folder = benchmarks_dir(args.benchmarks_dir)
    names = list(BENCHMARKS) if args.which == "all" else [args.which]
    commands = []
    for name in names:
        script = folder / BENCHMARKS[name]
        if not script.is_file():
            raise CommandError(f"benchmark script not found: {script}")
        commands.append([sys.executable, str(script)] + (["--quick"] if args.quick else []) + list(args.script_args))
    if args.dry_run:
        for command in commands:
            print(" ".join(command))
        return 0
    if not torch.cuda.is_available():
        raise CommandError("no CUDA device found: the kernel microbenchmarks time Triton kernels on a GPU. "
                           "Run `specdec bench --cpu-smoke` for a quick CPU smoke run of the torch references, or "
                           "`specdec bench --dry-run` to see the commands")
    for command in commands:
        print("+ " + " ".join(command), flush=True)
        completed = subprocess.run(command, cwd=folder.parent, check=False)
        if completed.returncode != 0:
            raise CommandError(f"{Path(command[1]).name} exited with status {completed.returncode}")
    return 0
