"""A layer-skip self-drafter (the verifier's first layers, final norm and head) is a valid drafter: it shares or
copies the verifier's weights as asked, computes exactly the truncated network, and generation with it is lossless."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import specdec
from specdec.decoding.self_drafter import layer_skip_drafter

from models import left_padded_prompts, tiny_llama

VOCAB = 96


def _truncated_logits(verifier, num_layers, input_ids):
    """Reference: the verifier's own modules applied by hand (embedding, first layers, norm, head)."""
    with torch.no_grad():
        out = verifier(input_ids, output_hidden_states=True)
        hidden = out.hidden_states[num_layers]  # after the first num_layers layers, before the final norm
        return verifier.lm_head(verifier.model.norm(hidden))


def test_shared_drafter_uses_the_verifiers_weights_and_computes_the_truncated_network():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=4, seed=0, init_std=0.3)
    drafter = layer_skip_drafter(verifier, 2)
    assert drafter.config.num_hidden_layers == 2 and verifier.config.num_hidden_layers == 4
    assert len(drafter.model.layers) == 2 and len(verifier.model.layers) == 4
    verifier_storage = {p.data_ptr() for p in verifier.parameters()}
    assert {p.data_ptr() for p in drafter.parameters()} <= verifier_storage
    assert sum(p.numel() for p in drafter.parameters()) < sum(p.numel() for p in verifier.parameters())
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = drafter(input_ids).logits
    torch.testing.assert_close(logits, _truncated_logits(verifier, 2, input_ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, verifier(input_ids).logits.detach(), atol=1e-3), "4 layers differ from 2"


def test_copied_drafter_trains_without_touching_the_verifier():
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=3, seed=1, init_std=0.3)
    before = {name: p.detach().clone() for name, p in verifier.named_parameters()}
    drafter = layer_skip_drafter(verifier, 1, share_weights=False)
    assert not {p.data_ptr() for p in drafter.parameters()} & {p.data_ptr() for p in verifier.parameters()}
    optimizer = torch.optim.SGD(drafter.parameters(), lr=0.5)
    input_ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    drafter.train()
    drafter(input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    assert all(torch.equal(p, before[name]) for name, p in verifier.named_parameters())
    assert any(not torch.equal(p, before[f"model.layers.0.{name}"]) for name, p
               in drafter.model.layers[0].named_parameters())


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_generation_with_a_self_drafter_equals_the_verifiers_greedy_decoding(static):
    verifier = tiny_llama(vocab_size=VOCAB, hidden_size=64, num_layers=4, seed=2, init_std=0.3)
    drafter = layer_skip_drafter(verifier, 2)
    input_ids, attention_mask = left_padded_prompts([5, 9, 3], VOCAB, seed=3)
    expected = verifier.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20,
                                 eos_token_id=[], pad_token_id=0)
    out = specdec.generate(verifier, drafter, input_ids, attention_mask, max_new_tokens=20, num_draft_tokens=3,
                           pad_token_id=0, static=static)
    assert torch.equal(out.sequences, expected)
    assert out.stats.path == ("static" if static else "eager")
    assert 0 < out.stats.total_acceptance_rate < 1


def test_other_architectures_and_bad_arguments():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=2, n_positions=64)).eval()
    drafter = layer_skip_drafter(gpt2, 1)
    assert len(drafter.transformer.h) == 1 and drafter.config.n_layer == 1 and gpt2.config.n_layer == 3
    input_ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = gpt2(input_ids, output_hidden_states=True).hidden_states[1]
        torch.testing.assert_close(drafter(input_ids).logits, gpt2.lm_head(gpt2.transformer.ln_f(hidden)))
    verifier = tiny_llama(vocab_size=VOCAB, num_layers=2)
    for bad in (0, 2, 1.5, "1"):
        with pytest.raises(ValueError, match=r"num_layers must be an integer in \[1, 1\]"):
            layer_skip_drafter(verifier, bad)
    with pytest.raises(TypeError, match="share_weights must be True or False"):
        layer_skip_drafter(verifier, 1, share_weights="yes")
    with pytest.raises(TypeError, match="verifier must be a Hugging Face causal LM"):
        layer_skip_drafter(torch.nn.Linear(2, 2), 1)


def test_a_model_without_a_list_of_decoder_layers_is_refused():
    """The drafter keeps a prefix of the base model's one nn.ModuleList of layers; a model without one is refused."""
    verifier = tiny_llama(vocab_size=VOCAB, num_layers=2)
    verifier.model.layers = torch.nn.Sequential(*verifier.model.layers)  # the layers, but in no ModuleList
    with pytest.raises(TypeError, match="LlamaForCausalLM keeps no list of 2 decoder layers in its base model"):
        layer_skip_drafter(verifier, 1)
    verifier.config.num_hidden_layers = 3  # a list there, but not of the layers the config counts
    verifier.model.layers = torch.nn.ModuleList(verifier.model.layers)
    with pytest.raises(TypeError, match="keeps no list of 3 decoder layers"):
        layer_skip_drafter(verifier, 1)
