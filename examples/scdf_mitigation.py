"""Reduce the disparity with s-CDF (drafter-only finetuning) and compare it with the baselines side by side.

Example (MGSM-style folder; the first ``--eval-examples`` rows of each task are held out for evaluation)::

    python examples/scdf_mitigation.py ../shared/data/mgsm --verifier path/or/id --drafter path/or/id \\
        --methods none,uniform_kd,balanced,exact_variance,scdf --steps 200 --out runs/scdf

Every method starts from the same drafter. The table lists U (on the weight basis and on CE), the mean and the worst
task's acceptance and speed-up: U alone can be lowered by making the good tasks worse (the exact-variance weights do
that), so judge a method by all of them. With ``--save-dir`` the finetuned drafters are saved with
``save_pretrained``; under ``torchrun`` finetuning runs with DDP.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from disparity_report import add_model_arguments, load_models  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--methods", default="none,uniform_kd,balanced,exact_variance,scdf")
    parser.add_argument("--weight-basis", default="ce", choices=["ce", "kl", "tv"])
    parser.add_argument("--weight-floor", type=float, default=0.0)
    parser.add_argument("--eval-examples", type=int, default=8, help="rows per task held out for evaluation")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size-per-task", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cost-ratio", type=float, default=None, help="t_drafter / t_verifier (default: measured)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoints (one subfolder per method), resumable")
    parser.add_argument("--save-dir", default=None, help="save each finetuned drafter here (one folder per method)")
    parser.add_argument("--out", default="scdf_mitigation", help="output folder for results.json and reports")
    args = parser.parse_args(argv)

    from specdec.data import load_tasks
    from specdec.fairness import CostRatio, TaskData, evaluate
    from specdec.fairness.speed import resolve_cost_ratio
    from specdec.training.finetune import METHODS, FinetuneConfig, finetune_drafter

    methods = args.methods.split(",")
    unknown = [m for m in methods if m != "none" and m not in METHODS]
    if unknown:
        parser.error(f"unknown --methods {unknown}; choose from none,{','.join(METHODS)}")
    try:  # the training settings shared by every method, checked before any model is loaded
        settings = FinetuneConfig(weight_basis=args.weight_basis, weight_floor=args.weight_floor, steps=args.steps,
                                  batch_size_per_task=args.batch_size_per_task, seq_len=args.seq_len, lr=args.lr,
                                  temperature=args.temperature, eval_every=args.eval_every, seed=args.seed)
        given_cost = None if args.cost_ratio is None else CostRatio(value=args.cost_ratio, source="given")
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    tasks = load_tasks(args.data)
    if args.tasks:
        wanted = args.tasks.split(",")
        missing = [name for name in wanted if name not in tasks]
        if missing:
            parser.error(f"--tasks {missing} not in the data; it has {sorted(tasks)}")
        tasks = {name: tasks[name] for name in wanted}
    held_out = {n: TaskData(prompts=(t.prompts or [])[:args.eval_examples] or None,
                            texts=(t.texts or [])[:args.eval_examples] or None) for n, t in tasks.items()}
    held_out_texts = {n: list(t.texts or t.prompts) for n, t in held_out.items() if t.texts or t.prompts} or None
    train = {n: (t.texts or [])[args.eval_examples:][:args.max_examples] for n, t in tasks.items()}
    empty = [n for n, texts in train.items() if not texts]
    if empty:
        parser.error(f"tasks {empty} have no training rows left after --eval-examples={args.eval_examples}")
    rank = 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: one process per GPU, DDP inside finetune
        import torch
        import torch.distributed as dist

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            args.device = args.device or f"cuda:{torch.cuda.current_device()}"
        dist.init_process_group("nccl" if cuda else "gloo")
        rank = dist.get_rank()
    verifier, drafter0, tokenizer = load_models(args)
    eval_batch_size = 8
    # c once for every method (finetuning changes the drafter's weights, not its cost); a measured one keeps its label
    # and spread in every report
    cost = resolve_cost_ratio(given_cost, verifier, drafter0, batch_size=eval_batch_size,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    if rank == 0:
        print(cost.describe())
    eval_kwargs = dict(tokenizer=tokenizer, num_draft_tokens=args.num_draft_tokens, temperature=args.temperature,
                       max_new_tokens=args.max_new_tokens, batch_size=eval_batch_size, cost_ratio=cost, seed=args.seed,
                       eos_token_id=getattr(tokenizer, "eos_token_id", None), add_special_tokens=not args.no_bos)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for method in methods:
        drafter = copy.deepcopy(drafter0)
        history = None
        if method != "none":
            checkpoint_dir = os.path.join(args.checkpoint_dir, method) if args.checkpoint_dir else None
            config = settings.replace(method=method, checkpoint_dir=checkpoint_dir)
            # the held-out texts above are finetune's evaluation set too: every training text is trained on
            result = finetune_drafter(drafter, verifier, train, config=config, tokenizer=tokenizer,
                                      eval_tasks=held_out_texts, add_special_tokens=not args.no_bos,
                                      pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0)
            history = result.history
            if args.save_dir and rank == 0:
                drafter.save_pretrained(os.path.join(args.save_dir, method))
        report = evaluate(verifier, drafter.eval(), held_out, progress=rank == 0, **eval_kwargs)
        with open(os.path.join(args.out, f"report_{method}.md"), "w", encoding="utf-8") as f:
            f.write(report.to_markdown())
        s = report.summary
        results[method] = {"U": s[f"U_{args.weight_basis}"], "U_ce": s["U_ce"], "U_kl": s["U_kl"],
                           "mean_alpha": s["alpha_mean"], "worst_alpha": s["alpha_min"], "worst_task": s["worst_task"],
                           "mean_speedup": s["speedup_predicted_mean"], "worst_speedup": s["speedup_predicted_min"],
                           "history": history}
        del drafter
    if rank != 0:
        return results
    print(f"weights on {args.weight_basis}; U is the variance over tasks of K_T (CE) or D_T (KL)")
    print(f"{'method':<16}{'U (CE)':>11}{'U (KL)':>11}{'mean α':>9}{'worst α':>9}{'mean S':>9}{'worst S':>9}"
          "  worst task")
    for method, r in results.items():
        print(f"{method:<16}{r['U_ce']:>11.3e}{r['U_kl']:>11.3e}{r['mean_alpha']:>9.4f}{r['worst_alpha']:>9.4f}"
              f"{r['mean_speedup']:>9.3f}{r['worst_speedup']:>9.3f}  {r['worst_task']}")
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
