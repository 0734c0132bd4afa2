"""Quick start: speculative decoding with ``specdec.generate`` on the built-in demo pair (CPU, offline).

The first run trains the small verifier/drafter pair (about two minutes on two CPU cores) and caches it; later runs
load it at once. Run: ``python examples/quickstart.py``.
"""

import torch

import specdec
from specdec.cli.demo import get_demo_pair

pair = get_demo_pair()  # cached under $SPECDEC_CACHE, $XDG_CACHE_HOME/specdec or ~/.cache/specdec
tokenizer = pair.tokenizer
prompts = ["count 41:", "3+4=7;", "the old fox sees a cat. ", "тхе олд фож сеес а цат. "]
batch = tokenizer(prompts, padding=True, return_tensors="pt")  # left-padded, with <bos>

with torch.no_grad():
    out = specdec.generate(
        pair.verifier, pair.drafter, batch["input_ids"], batch["attention_mask"],
        max_new_tokens=32, num_draft_tokens=4, temperature=0.0,  # greedy: exactly the verifier's own output
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )

width = batch["input_ids"].shape[1]
for row, prompt in enumerate(prompts):
    new_tokens = out.sequences[row, width:width + int(out.stats.generated[row])]
    print(f"{prompt!r} -> {tokenizer.decode(new_tokens, skip_special_tokens=True)!r}  "
          f"({out.stats.tokens_per_verifier_call[row]:.2f} tokens per verifier call, "
          f"{out.stats.acceptance_rate[row]:.0%} of drafts accepted)")
print("overall:", {key: value for key, value in out.stats.summary().items() if key != "acceptance_per_position"})
