"""How repeatable the measured cost ratio c is on this machine: ``measure_decode_costs`` five times on one pair.

Builds two random-weight Llama models that differ only in depth (a verifier of ``--verifier-layers`` and a drafter of
``--drafter-layers`` layers, both ``--hidden`` wide, so a step takes milliseconds rather than microseconds on a CPU),
then measures c = t_drafter / t_verifier ``--runs`` times back to back with :func:`specdec.measure_decode_costs`. It
prints each c with the spread of its per-repetition ratios and the max/min of the runs' c. The tests assert no timing;
this is where the repeatability of c is checked, by hand, on the machine at hand.

    python benchmarks/tools/cost_ratio_repeatability.py                  # CPU, one torch thread
    python benchmarks/tools/cost_ratio_repeatability.py --device cuda    # the static path with CUDA graphs
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import measure_decode_costs


def random_llama(hidden: int, layers: int, vocab: int, seed: int) -> LlamaForCausalLM:
    """A float32 Llama with random weights, in eval mode (nothing is downloaded)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or a CUDA device")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--verifier-layers", type=int, default=4)
    parser.add_argument("--drafter-layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5, help="measurements of c (default 5)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repetitions within one measurement")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    verifier = random_llama(args.hidden, args.verifier_layers, args.vocab, seed=0).to(device)
    drafter = random_llama(args.hidden, args.drafter_layers, args.vocab, seed=1).to(device)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"device {device}; verifier {args.verifier_layers} layers, drafter {args.drafter_layers} layers, hidden "
          f"{args.hidden}, batch {args.batch_size}, {args.new_tokens} new tokens, {args.repeats} repetitions per run")
    values = []
    for run in range(args.runs):
        started = time.perf_counter()
        cost = measure_decode_costs(verifier, drafter, batch_size=args.batch_size, new_tokens=args.new_tokens,
                                    repeats=args.repeats)
        values.append(cost.value)
        print(f"run {run + 1}: c = {cost.value:.4f} ({cost.path} path; p20–p80 {cost.ratio_p20:.4f}–"
              f"{cost.ratio_p80:.4f}, min–max {cost.ratio_min:.4f}–{cost.ratio_max:.4f}; step "
              f"{cost.drafter_step_s * 1e3:.3f} ms drafter / {cost.verifier_step_s * 1e3:.3f} ms verifier; "
              f"{time.perf_counter() - started:.1f} s)")
    low, high = min(values), max(values)
    print(f"c over {args.runs} runs: min {low:.4f}, max {high:.4f}, max/min {high / low:.4f}")
    return values


if __name__ == "__main__":
    main()
