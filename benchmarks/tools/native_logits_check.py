"""The native decode runner's logits against the Hugging Face forward's, on the GPU (kernels compiled, not
interpreted): random-weight models of every native family, ragged left-padded prompts, then steps of T = 1, 2 and
K + 1 = 5 tokens with rows advancing by different amounts (rejected drafts left behind in the cache).

For each step: the largest |native - hf| over the largest |hf| logit, and the share of rows whose argmax agrees.
In 16-bit dtypes both runs are also compared with the same weights in float32 (HF forward): ``err_native`` and
``err_hf`` are each one's largest distance to that float32 truth, so the native runner is within the dtype's
rounding when ``err_native`` is about ``err_hf`` or below.

    python benchmarks/tools/native_logits_check.py                     # tiny models of every family + llama-1b
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specdec.decoding.native import NativeModelSlot  # noqa: E402
from specdec.decoding.static import _ModelSlot  # noqa: E402

from models import left_padded_prompts, tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3  # noqa: E402


def run_steps(slot, input_ids, attention_mask, plan):
    """Prompt pass, then the steps of ``plan`` [(T, advance per row)]; the logits of each call (float32, CPU)."""
    batch, prompt_len = input_ids.shape
    slots = torch.arange(prompt_len, device=input_ids.device).expand(batch, prompt_len)
    outputs = [slot.forward(input_ids, slots, 1, eager=True).float().cpu()]
    generator = torch.Generator().manual_seed(3)
    n = torch.full((batch,), prompt_len, device=input_ids.device)
    vocab = slot.vocab
    for steps, advance in plan:
        ids = torch.randint(0, vocab, (batch, steps), generator=generator).to(input_ids.device)
        outputs.append(slot.forward(ids, n[:, None] + torch.arange(steps, device=n.device), steps).float().cpu())
        n = n + advance.to(n.device)
    return outputs


def states(model, batch, capacity, attention_mask):
    prompt_len = attention_mask.shape[1]
    device = attention_mask.device
    key_ok = torch.ones((batch, capacity), dtype=torch.bool, device=device)
    key_ok[:, :prompt_len] = attention_mask.bool()
    real = attention_mask.sum(1, keepdim=True)
    positions = torch.arange(capacity, device=device) - prompt_len + real
    positions[:, :prompt_len] = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return key_ok, positions


def check(name, model, dtype, lengths, capacity=128):
    device = torch.device("cuda")
    model = model.to(device=device, dtype=dtype).eval()
    vocab = model.config.vocab_size
    input_ids, attention_mask = left_padded_prompts(lengths, vocab, seed=1)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    batch = len(lengths)
    advance = torch.tensor([1, 2, 3, 1, 2, 5, 4, 1][:batch])
    plan = [(1, torch.ones(batch, dtype=torch.int64)), (2, torch.ones(batch, dtype=torch.int64)), (5, advance),
            (1, torch.ones(batch, dtype=torch.int64))]
    key_ok, positions = states(model, batch, capacity, attention_mask)
    with torch.no_grad():
        hf = run_steps(_ModelSlot(model, batch, capacity, vocab, key_ok, positions), input_ids, attention_mask, plan)
        native = run_steps(NativeModelSlot(model, batch, capacity, vocab, key_ok, positions), input_ids,
                           attention_mask, plan)
        truth = None
        if dtype != torch.float32:
            exact = copy.deepcopy(model).float()
            truth = run_steps(_ModelSlot(exact, batch, capacity, vocab, key_ok, positions), input_ids,
                              attention_mask, plan)
            del exact
    for index, (a, b) in enumerate(zip(native, hf, strict=True)):
        scale = b.abs().max().item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
        line = (f"{name:10s} {str(dtype):15s} call {index} T={a.shape[1]}: |native - hf| / max|hf| = "
                f"{(a - b).abs().max().item() / scale:.2e}, argmax agree {agree:.3f}")
        if truth is not None:
            t = truth[index]
            line += (f", err_native {(a - t).abs().max().item() / scale:.2e}"
                     f", err_hf {(b - t).abs().max().item() / scale:.2e}")
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-1b", dest="big", action="store_false", help="leave out the llama-1b shape")
    args = parser.parse_args()
    factories = {"llama": tiny_llama, "mistral": lambda **k: tiny_mistral(None, **k), "qwen2": tiny_qwen2,
                 "qwen3": tiny_qwen3}
    for name, factory in factories.items():
        for dtype in (torch.float32, torch.bfloat16):
            check(name, factory(hidden_size=128, init_std=0.1, seed=0), dtype, [9, 4, 7])
    if args.big:
        from bench_generate import build_pair

        verifier, _ = build_pair("llama-1b", 1)
        check("llama-1b", verifier, torch.bfloat16, [33, 20, 31, 12, 33, 5, 27, 33], capacity=256)


if __name__ == "__main__":
    main()
