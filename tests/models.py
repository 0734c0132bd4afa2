"""Tiny random-weight Llama-family models for tests (built from configs: nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int = 96, hidden_size: int = 32, num_layers: int = 2, seed: int = 0,
               init_std: float = 0.02, **overrides: object) -> LlamaForCausalLM:
    """A float32 Llama with random weights, in eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=init_std,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
        **{"tie_word_embeddings": False, **overrides},
    )
    model = LlamaForCausalLM(config).eval()
    return model


def tiny_mistral(sliding_window: int | None, vocab_size: int = 96, hidden_size: int = 32, seed: int = 0,
                 init_std: float = 0.3, num_layers: int = 2):
    """A float32 Mistral (sliding-window attention over ``sliding_window`` positions) with random weights."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=init_std, sliding_window=sliding_window, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )
    return MistralForCausalLM(config).eval()


def tiny_qwen2(vocab_size: int = 96, hidden_size: int = 32, num_layers: int = 2, seed: int = 0, init_std: float = 0.02,
               **overrides: object):
    """A float32 Qwen2 (biases on the query, key and value projections) with random weights, in eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=init_std, use_sliding_window=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager", **{"tie_word_embeddings": False, **overrides},
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # (HF initialises biases to zero: random ones, so that they are tested)
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, init_std)
    return model


def tiny_qwen3(vocab_size: int = 96, hidden_size: int = 32, num_layers: int = 2, seed: int = 0, init_std: float = 0.02,
               **overrides: object):
    """A float32 Qwen3 (per-head RMS norms of queries and keys) with random weights, in eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=512, initializer_range=init_std, use_sliding_window=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, attn_implementation="eager", **{"tie_word_embeddings": False, **overrides},
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # (HF initialises the per-head norms to one: random ones, so that they are tested)
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 1.5)
    return model


def perturbed_copy(model: LlamaForCausalLM, noise: float, seed: int = 0) -> LlamaForCausalLM:
    """A drafter close to ``model``: same architecture, weights plus Gaussian noise of relative scale ``noise``."""
    generator = torch.Generator().manual_seed(seed)
    drafter = LlamaForCausalLM(model.config).eval()
    with torch.no_grad():
        for (_, source), (_, target) in zip(model.named_parameters(), drafter.named_parameters(), strict=True):
            target.copy_(source + noise * source.std() * torch.randn(source.shape, generator=generator))
    return drafter


def left_padded_prompts(lengths: list[int], vocab_size: int, seed: int = 0, pad_id: int = 0):
    """[B, max(lengths)] int64 prompts of the given lengths, left-padded with ``pad_id``, and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.int64)
    for row, length in enumerate(lengths):
        input_ids[row, width - length:] = torch.randint(3, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length:] = 1
    return input_ids, attention_mask


def byte_level_tokenizer(vocab_size: int = 400, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer trained here on ``corpus`` (default: a few English sentences): every text encodes
    (no unknown tokens), tokens have several characters, padding is on the left, ids 0..3 are
    ``<pad> <bos> <eos> <unk>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = corpus or 5 * ["the cat sat on the mat and the dog sat on the log",
                            "a quick brown fox jumps over the lazy dog",
                            "one two three four five six seven eight nine ten", "stop here. then go there; stop again!"]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", padding_side="left")
