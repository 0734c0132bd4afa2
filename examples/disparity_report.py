"""Measure how unequally a drafter-verifier pair accelerates each task or language.

Example (MGSM folder of ``mgsm_<lang>.tsv`` files, ``question<TAB>answer`` rows; one task per language)::

    python examples/disparity_report.py ../shared/data/mgsm --verifier path/or/id --drafter path/or/id \\
        --max-examples 32 --out reports/mgsm

Writes ``report.md``, ``report.json`` and ``report.png`` to ``--out`` and prints the markdown table: per task the
teacher-forced acceptance alpha_T, speed-up S_T, K_T / D_T / TV_T, the speed-up bounds, the acceptance measured from
real speculative decoding on the prompts, and per-character figures; across tasks U on K_T and D_T and the spreads.
Models are Hugging Face ids or local folders (nothing else is downloaded); ``--tokenizer char`` uses specdec's
built-in character tokenizer (for models trained with it).
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def load_models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # local folders or the local Hugging Face cache only: nothing is downloaded at run time
    try:
        verifier = AutoModelForCausalLM.from_pretrained(args.verifier, dtype=dtype, local_files_only=True)
        drafter = AutoModelForCausalLM.from_pretrained(args.drafter, dtype=dtype, local_files_only=True)
        if args.tokenizer == "char":
            from specdec.data import build_char_tokenizer

            tokenizer = build_char_tokenizer()
        else:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.verifier, local_files_only=True)
    except OSError as exc:
        raise SystemExit(f"could not load the models or tokenizer from local files ({exc}); pass local folders "
                         "(e.g. the demo's: specdec demo prints where it keeps them) or ids already in the "
                         "Hugging Face cache") from None
    return verifier.to(device).eval(), drafter.to(device).eval(), tokenizer


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", help="task data: an MGSM-style folder of <name>_<lang>.tsv, a .tsv or a .jsonl file")
    parser.add_argument("--verifier", required=True, help="Hugging Face id or local folder of the verifier")
    parser.add_argument("--drafter", required=True, help="Hugging Face id or local folder of the drafter")
    parser.add_argument("--tokenizer", default=None, help="tokenizer id/folder (default: the verifier's); 'char' = "
                        "specdec's character tokenizer")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--tasks", default=None, help="comma-separated subset of task names")
    parser.add_argument("--max-examples", type=int, default=32, help="prompts and texts per task")
    parser.add_argument("--no-bos", action="store_true", help="encode texts without the tokenizer's special tokens")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512, help="truncate reference texts to this many tokens")
    parser.add_argument("--cost-ratio", type=float, default=None, help="t_drafter / t_verifier (default: measured)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="disparity_report", help="output folder")
    args = parser.parse_args(argv)

    from specdec.data import load_tasks
    from specdec.fairness import evaluate

    tasks = load_tasks(args.data, max_examples=args.max_examples)
    if args.tasks:
        wanted = args.tasks.split(",")
        missing = sorted(set(wanted) - set(tasks))
        if missing:
            parser.error(f"--tasks names not in the data: {missing} (available: {sorted(tasks)})")
        tasks = {name: tasks[name] for name in wanted}
    verifier, drafter, tokenizer = load_models(args)
    report = evaluate(verifier, drafter, tasks, tokenizer=tokenizer, num_draft_tokens=args.num_draft_tokens,
                      temperature=args.temperature, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                      cost_ratio=args.cost_ratio, seed=args.seed, max_length=args.max_length,
                      eos_token_id=getattr(tokenizer, "eos_token_id", None), add_special_tokens=not args.no_bos)
    os.makedirs(args.out, exist_ok=True)
    markdown = report.to_markdown()
    with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    with open(os.path.join(args.out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=2)
    report.plot(os.path.join(args.out, "report.png"))
    print(markdown)
    print(f"wrote {args.out}/report.md, report.json, report.png")
    return report.to_dict()


if __name__ == "__main__":
    main()
