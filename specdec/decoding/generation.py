"""Lossless speculative decoding for any pair of Hugging Face causal LMs that share a vocabulary.

One round: the drafter proposes K tokens autoregressively (K cheap forward calls), the verifier scores the pending
token and all K drafts in one forward call, and :func:`specdec.rejection_sample` keeps a prefix of the drafts plus
one recovered/bonus token, so the output follows the verifier's own distribution exactly.

Two paths run the rounds. The static path (``specdec.decoding.static``; the default on CUDA) keeps preallocated KV
caches with one write position per row and replays each round from a CUDA graph. The eager path
(``specdec.decoding.eager``) uses the models' dynamic caches and runs anywhere; models the static path cannot handle
fall back to it, and ``stats.fallback_reason`` says why.
"""

from __future__ import annotations

import numbers
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec._models import check_model_pair, model_device, model_vocab_size, pair_in_eval_mode, sliding_window
from specdec._validation import (
    check_backend,
    check_int_at_least,
    check_int_range,
    check_temperature,
    check_tensor,
    check_verification,
    eos_id_list,
)
from specdec.compat import SpecdecWarning, pair_positions
from specdec.decoding.draft_length import AUTO_DRAFT_LENGTHS
from specdec.decoding.eager import DecodeResult, decode_eager
from specdec.decoding.hf_options import resolve_options
from specdec.decoding.native import native_problem
from specdec.decoding.ngram import NgramDrafter, as_ngram_drafter, drafter_model
from specdec.decoding.slot_cache import fast_path_problem
from specdec.decoding.static import Sampling, clear_engines, decode_static, get_engine
from specdec.decoding.stop_strings import StopStringChecker

_DRAFT_STREAM_SALT = 0x5DEECE66D  # separates the drafter's random stream from the sampler's


@dataclass
class SpecDecodeStats:
    """Counters of a :func:`generate` call, per row ([B] or [B, K] int64 tensors on the CPU) and aggregated.

    drafted: drafts proposed while the row was active. accepted: drafts the verifier accepted.
    generated: tokens emitted into the output. verifier_calls / drafter_calls: forward calls while active; on both
    paths the first verifier call is the prompt pass, which emits the first token, and every later one is a round
    (so ``generated / verifier_calls`` sits below E[N] by about one round's share; :attr:`tokens_per_round` does not).
    accepted_per_position / attempted_per_position: [B, K] counts of acceptance tests at draft position j.
    wall_time_s: wall-clock time of the whole call (device synchronised). time_to_first_token_s: wall-clock time from
    the call's start until the prompt pass's token was on the host (setup and capture included);
    ``wall_time_s - time_to_first_token_s`` is the rounds' time.
    num_draft_tokens: K (the largest K for ``"auto"``). draft_lengths: the K of every round, in order.
    path: ``"static"`` (slot caches, CUDA graphs on CUDA) or ``"eager"`` (dynamic caches).
    fallback_reason: why the static path was not used, when it was asked for or would be the default; with
    ``runner="native"``, why a model did not run on the native decode runner; else None.
    runner: ``"native"`` when every model of the call ran its decoding steps on the native decode runner (the static
    path), else ``"hf"`` (each model's own Hugging Face forward).
    setup_time_s: graph capture, compilation and round timing paid by this call (about 0 when a previous call's are
    reused). compiled: whether ``compile=True`` took effect (only the static path compiles).
    """

    drafted: torch.Tensor
    accepted: torch.Tensor
    generated: torch.Tensor
    verifier_calls: torch.Tensor
    drafter_calls: torch.Tensor
    accepted_per_position: torch.Tensor
    attempted_per_position: torch.Tensor
    wall_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    num_draft_tokens: int = field(default=1)
    draft_lengths: list[int] = field(default_factory=list)
    path: str = "eager"
    fallback_reason: str | None = None
    setup_time_s: float = 0.0
    compiled: bool = False
    runner: str = "hf"

    @property
    def acceptance_rate(self) -> torch.Tensor:
        """[B] float: accepted / drafted (NaN for a row that drafted nothing)."""
        return self.accepted.double() / self.drafted.double()

    @property
    def acceptance_per_position(self) -> torch.Tensor:
        """[B, K] float: P(accept draft j | draft j was tested); NaN where never tested."""
        return self.accepted_per_position.double() / self.attempted_per_position.double()

    @property
    def tokens_per_verifier_call(self) -> torch.Tensor:
        """[B] float: generated tokens per verifier forward call."""
        return self.generated.double() / self.verifier_calls.double()

    @property
    def tokens_per_round(self) -> torch.Tensor:
        """[B] float: tokens emitted per round after the prompt pass, ``(generated - 1) / (verifier_calls - 1)``,
        the measured counterpart of E[N] (NaN for a row that ended at its first token)."""
        return (self.generated.double() - 1) / (self.verifier_calls.double() - 1)

    @property
    def total_acceptance_rate(self) -> float:
        return float(self.accepted.sum()) / max(int(self.drafted.sum()), 1)

    @property
    def total_acceptance_per_position(self) -> torch.Tensor:
        """[K] float: acceptance at draft position j pooled over rows (0 where no row ever tested position j, so
        that summaries stay JSON numbers; :attr:`acceptance_per_position` gives NaN there)."""
        return self.accepted_per_position.sum(0).double() / self.attempted_per_position.sum(0).clamp(min=1).double()

    @property
    def total_tokens_per_verifier_call(self) -> float:
        """Pooled generated tokens per verifier call (a batched call counts once per active row)."""
        return float(self.generated.sum()) / max(int(self.verifier_calls.sum()), 1)

    @property
    def total_tokens_per_round(self) -> float:
        """Pooled tokens per verifier round after the prompt pass (NaN when no row ran a round)."""
        rounds = int(self.verifier_calls.sum()) - self.verifier_calls.numel()
        return (int(self.generated.sum()) - self.generated.numel()) / rounds if rounds > 0 else float("nan")

    def summary(self) -> dict[str, float | list[float]]:
        """Aggregated figures as plain Python numbers."""
        return {
            "drafted": int(self.drafted.sum()),
            "accepted": int(self.accepted.sum()),
            "generated": int(self.generated.sum()),
            "verifier_calls": int(self.verifier_calls.max()) if self.verifier_calls.numel() else 0,
            "drafter_calls": int(self.drafter_calls.max()) if self.drafter_calls.numel() else 0,
            "acceptance_rate": self.total_acceptance_rate,
            "acceptance_per_position": self.total_acceptance_per_position.tolist(),
            "tokens_per_verifier_call": self.total_tokens_per_verifier_call,
            "tokens_per_round": self.total_tokens_per_round,
            "compiled": self.compiled,
            "wall_time_s": self.wall_time_s,
            "time_to_first_token_s": self.time_to_first_token_s,
            "path": self.path,
            "runner": self.runner,
            "fallback_reason": self.fallback_reason,
            "setup_time_s": self.setup_time_s,
            "mean_draft_length": sum(self.draft_lengths) / max(len(self.draft_lengths), 1),
        }


@dataclass
class GenerateOutput:
    """sequences: [B * num_return_sequences, prompt_len + generated] int64, the prompt as given then the new tokens,
    right-padded with ``pad_token_id`` after a row ends. stats: :class:`SpecDecodeStats`. logprobs: with
    ``output_logprobs=True``, [B * num_return_sequences, generated] float32, the verifier's log-probability of each
    new token under the law it was drawn from (0 after a row's end), else None."""

    sequences: torch.Tensor
    stats: SpecDecodeStats
    logprobs: torch.Tensor | None = None


@pair_in_eval_mode
@torch.no_grad()
def generate(
    verifier: torch.nn.Module,
    drafter: torch.nn.Module | NgramDrafter | str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int | None = None,
    num_draft_tokens: int | str = 4,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    backend: str = "auto",
    pad_token_id: int | None = None,
    vocab_size: int | None = None,
    progress: bool = False,
    static: bool | None = None,
    compile: bool = False,
    generation_config: Any = None,
    streamer: Any = None,
    min_new_tokens: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: Any = None,
    repetition_penalty: float | None = None,
    num_return_sequences: int | None = None,
    output_logprobs: bool = False,
    runner: str = "auto",
    verification: str = "token",
    **hf_options: Any,
) -> GenerateOutput:
    """Speculative decoding whose output follows ``verifier`` exactly (greedy or sampled); a drop-in for
    ``verifier.generate(...)`` that keeps transformers' option names and meanings.

    The token-dependent processors (``repetition_penalty``, ``min_new_tokens``) are applied identically to the
    drafter and the verifier, position by position inside a round (the context of draft position j includes the
    drafts before it), so greedy decoding equals ``verifier.generate`` with the same options token for token
    (float32) and sampling follows the verifier's processed law exactly.

    Parameters
    ----------
    verifier, drafter : transformers causal LMs
        ``model(input_ids, attention_mask, position_ids, cache)`` on one device, sharing a vocabulary. The drafter
        may instead be model-free: :func:`specdec.ngram_drafter` (or ``"ngram"`` for its defaults) proposes the token
        that followed the most recent earlier occurrence of the row's last n tokens, as a one-hot law (lossless as
        any drafter).
    input_ids : torch.Tensor
        [B, L] int64 prompts, left-padded.
    attention_mask : torch.Tensor, optional
        [B, L] 0/1 (default: all ones).
    max_new_tokens : int, optional
        Per-row cap on new tokens (>= 1). Default: the ``generation_config``'s (``max_length`` minus the L columns
        when only that is set), else 128.
    num_draft_tokens : int or "auto"
        K >= 0 drafts per round (0: plain decoding with the verifier alone; capped at ``max_new_tokens - 1``, the most
        a round can emit after the prompt pass), or ``"auto"``: K chosen before every round from the measured
        acceptance and round times among ``(0, 1, 2, 3, 4, 6, 8)``.
    temperature : float, optional
        0 is greedy (a draft is accepted iff it is the verifier's argmax of the processed logits, ties to the lowest
        id); > 0 samples from ``softmax(filter(processors(logits) / T))``, ``filter`` being ``top_k`` then ``top_p``.
        Default: from ``do_sample`` and the ``generation_config`` as transformers reads them, else 0. An explicit
        temperature decides greedy or sampling unless ``do_sample`` is passed too.
    top_k, top_p : optional
        Sampling filters, identical for both models (default: the ``generation_config``'s, else 0 and 1.0).
    eos_token_id : int or list of int, optional
        A row stops after emitting one (default: the ``generation_config``'s, else none; ``[]`` overrides a
        configured one with none).
    seed : int, optional
        Makes sampling reproducible; both paths make the same draws, so a seed gives the same samples on either (for a
        fixed K). None draws the row seeds from torch's global generator, as in transformers.
    backend : {"auto", "triton", "torch"}
        Rejection-sampler backend.
    pad_token_id : int, optional
        Right-padding of finished rows (default: the ``generation_config``'s, else the first eos id, else 0).
    vocab_size : int, optional
        The number of real token ids (e.g. ``len(tokenizer)``), required when the models' vocab sizes differ
        (padding rows); only ids below it are used.
    progress : bool
        Show a tqdm bar over generated tokens.
    static : bool, optional
        The static path (preallocated per-row KV caches; on CUDA every round replayed from a CUDA graph). None: on for
        CUDA inputs, off on the CPU. A model it cannot run falls back to the eager path (``stats.fallback_reason``).
    compile : bool
        On the static path, fuse each HF forward with ``torch.compile`` before capture (tens of seconds once); models
        on the native runner are not compiled (``stats.compiled`` says whether any model was).
    generation_config : transformers.GenerationConfig, optional
        Read as transformers reads it: its unset fields come from ``verifier.generation_config``, then from
        transformers' global defaults (``max_length=20``, ``top_k=50``, ...). Keywords override it. Without it
        nothing is read from the model's own generation config.
    streamer : transformers streamer, optional
        Receives ``put(input_ids)`` first, then ``put(new_ids)`` ([1, n] int64 on the CPU) as each round commits
        tokens, then ``end()`` (``TextStreamer``, ``TextIteratorStreamer``); one sequence only (B x
        ``num_return_sequences`` = 1).
    min_new_tokens : int, optional
        The eos ids are banned (logit ``-inf``) until a row has this many new tokens (``min_length`` counts the
        prompt's columns too, as in transformers).
    stop_strings : str or list of str, optional
        A row stops after the token that completes one (that token is kept), with transformers'
        ``StopStringCriteria`` semantics; needs ``tokenizer``.
    tokenizer : transformers tokenizer, optional
        The models' tokenizer, for ``stop_strings``.
    repetition_penalty : float, optional
        θ > 0 (1.0: none): every id in the row's context (the prompt from its first attended column, and every new
        token) has its logit ``l`` scaled to ``l * θ`` if ``l < 0`` else ``l / θ``, before the temperature.
    num_return_sequences : int, optional
        n >= 1 continuations of every prompt (rows ``b * n .. b * n + n - 1``), each with its own random stream when
        sampling; greedy gives n equal copies.
    verification : {"token", "block"}
        How sampled rounds verify their drafts (:func:`specdec.rejection_sample`): "token" (default; each draft
        accepted with probability ``min(1, p/q)`` until the first rejection) or "block" (the drafts decided jointly,
        Sun et al., ICLR 2025: equally lossless, never fewer accepted drafts in expectation). Greedy decoding
        (``temperature=0``) is the arg-max rule under both.
    runner : {"auto", "native", "hf"}
        What runs a model's decoding steps on the static path. ``"native"``: the native decode runner (Llama,
        Mistral, Qwen2, Qwen3: specdec's kernels over the user's weights, a step costing about its weight reads; it
        implies the static path, also on the CPU); a model it cannot run keeps its HF forward and
        ``stats.fallback_reason`` says why. ``"auto"`` (default): native for every model it can run. ``"hf"``: each
        model's own forward. ``stats.runner`` reports the runner used. Models on the native runner are not
        compiled (``compile=True`` with ``runner="hf"`` compiles the HF forward).
    output_logprobs : bool
        Also return ``logprobs`` [B * n, generated] float32: the log-probability of each new token under the
        verifier's law it was drawn from, ``log_softmax(processed logits)`` (greedy: processors, temperature 1).
    **hf_options
        Other transformers ``generate`` options: ``do_sample``, ``max_length``, ``min_length`` and options that do
        not change the tokens (``use_cache``, ``return_dict_in_generate``, ...) are accepted; any other option set
        away from its default (``num_beams > 1``, ``logits_processor``, ``no_repeat_ngram_size``, ...) raises a
        ValueError naming it, as does such a field of ``generation_config``.

    Returns
    -------
    GenerateOutput
        ``sequences`` [B * n, L + max generated] int64, ``stats`` and ``logprobs``.

    Notes
    -----
    Both models run in eval mode for the call (a model built with ``Model(config)`` starts in train mode, and dropout
    would make the output follow no fixed law); their modes are restored afterwards.
    """
    drafter = as_ngram_drafter(drafter) or drafter
    drafter_facts = drafter_model(verifier, drafter)  # an n-gram drafter has the verifier's device and vocabulary
    check_model_pair(verifier, drafter_facts)
    check_tensor(input_ids, "input_ids", 2, integer_dtype=True, shape_doc="[B, L]")
    batch, prompt_len = input_ids.shape
    if batch == 0 or prompt_len == 0:
        raise ValueError(f"input_ids must be a non-empty [B, L] batch of prompts, got shape {tuple(input_ids.shape)}")
    options = resolve_options(verifier, prompt_len, generation_config, {
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
        "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "min_new_tokens": min_new_tokens,
        "stop_strings": stop_strings, "repetition_penalty": repetition_penalty,
        "num_return_sequences": num_return_sequences}, hf_options)
    max_new_tokens, temperature, top_k, top_p = (options.max_new_tokens, options.temperature, options.top_k,
                                                 options.top_p)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_tensor(attention_mask, "attention_mask", 2, shape_doc="[B, L]")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    device = input_ids.device
    for name, tensor_or_model in (("attention_mask", attention_mask), ("verifier", verifier),
                                  ("drafter", drafter_facts)):
        other = tensor_or_model.device if isinstance(tensor_or_model, torch.Tensor) else model_device(tensor_or_model)
        if other != device:
            raise ValueError(f"{name} is on {other} but input_ids is on {device}: move them to one device")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must contain only 0 and 1")
    if bool((attention_mask.sum(dim=1) == 0).any()):
        raise ValueError("input_ids has an empty prompt (a row whose attention_mask is all zeros)")
    if bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("input_ids must be left-padded: attention_mask[:, -1] is 0 in some row (tokenize with "
                         "padding_side='left'); generation continues from the last column")
    max_new_tokens = check_int_at_least(max_new_tokens, "max_new_tokens", 1)
    if isinstance(num_draft_tokens, str):
        if num_draft_tokens != "auto":
            raise ValueError(f"num_draft_tokens must be an integer >= 0 or 'auto', got {num_draft_tokens!r}")
        draft_lengths = AUTO_DRAFT_LENGTHS
    else:
        draft_lengths = (check_int_at_least(num_draft_tokens, "num_draft_tokens", 0),)
    # The prompt pass emits the first token: more drafts than the tokens left after it can never be emitted.
    useful_drafts = max_new_tokens - 1
    draft_lengths = tuple(sorted({min(k, useful_drafts) for k in draft_lengths}))
    max_drafts = max(draft_lengths)
    temperature = check_temperature(temperature)
    top_k = check_int_at_least(top_k, "top_k", 0)
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be a float in (0, 1], got {top_p!r}")
    top_p = float(top_p)
    if static is not None and not isinstance(static, bool):
        raise TypeError(f"static must be True, False or None, got {static!r}")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    if not isinstance(output_logprobs, bool):
        raise TypeError(f"output_logprobs must be True or False, got {output_logprobs!r}")
    copies = options.num_return_sequences
    if streamer is not None:
        if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
            raise TypeError(f"streamer must have put(token_ids) and end() (a transformers streamer), got "
                            f"{type(streamer).__name__}")
        if batch * copies != 1:
            raise ValueError(f"streamer streams one sequence: input_ids has {batch} row(s) x num_return_sequences="
                             f"{copies} (as transformers' TextStreamer, which supports batch size 1 only)")
    stop = StopStringChecker(tokenizer, options.stop_strings) if options.stop_strings else None
    if runner not in ("auto", "native", "hf"):
        raise ValueError(f"runner must be 'auto', 'native' or 'hf', got {runner!r}")
    if runner == "native" and static is False:
        raise ValueError("runner='native' runs on the static path: it cannot be combined with static=False")
    # The eager path's caches keep one slot layout for the whole batch: each round appends K + 1 slots and rows that
    # accept fewer drafts leave masked slots behind. A sliding window counts slots, not tokens (and transformers'
    # sliding cache layers cannot roll back past the window), so the window must hold every slot the call can create.
    most_slots = prompt_len + max_new_tokens * (max_drafts + 1)
    for name, model in (("verifier", verifier), ("drafter", drafter_facts)):
        window = sliding_window(model)
        if window is not None and most_slots >= window:
            raise ValueError(
                f"{name} uses sliding-window attention (window {window}); speculative decoding here needs prompt "
                f"length + max_new_tokens * (num_draft_tokens + 1) = {prompt_len} + {max_new_tokens} * "
                f"{max_drafts + 1} = {most_slots} below the window (shorten the prompt, max_new_tokens or "
                "num_draft_tokens)")
    check_backend(backend)
    check_verification(verification)
    verifier_vocab, drafter_vocab = model_vocab_size(verifier, "verifier"), model_vocab_size(drafter_facts, "drafter")
    if vocab_size is None:
        if verifier_vocab != drafter_vocab:
            raise ValueError(
                f"verifier and drafter vocabularies differ ({verifier_vocab} vs {drafter_vocab}); if they differ only "
                "by padding rows pass vocab_size=len(tokenizer) to use the shared id range"
            )
        vocab_size = verifier_vocab
    vocab = check_int_at_least(vocab_size, "vocab_size", 1)
    if vocab > min(verifier_vocab, drafter_vocab):
        raise ValueError(f"vocab_size={vocab} exceeds a model's vocabulary ({verifier_vocab}, {drafter_vocab})")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids must lie in [0, vocab_size={vocab})")
    eos_ids = eos_id_list(options.eos_token_id, vocab)
    pad_token_id = check_int_range(options.pad_token_id, "pad_token_id", 0, vocab, allow_none=True,
                                   note=" (vocab_size)")
    seed = check_int_range(seed, "seed", 0, 2**64, allow_none=True)
    pad = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    min_new = min(options.min_new_tokens, max_new_tokens) if eos_ids else 0
    _warn_past_positions(verifier, drafter_facts, prompt_len, max_new_tokens, max_drafts)
    prompt_ids = input_ids
    if copies > 1:
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        attention_mask = attention_mask.repeat_interleave(copies, dim=0)
        batch = batch * copies

    generator = None  # seed=None draws from torch's global generator, so torch.manual_seed reproduces a call
    if seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
    row_seeds = torch.randint(0, 2**62, (batch,), generator=generator, dtype=torch.int64).to(device)
    draft_seeds = row_seeds ^ _DRAFT_STREAM_SALT
    sampling = Sampling(greedy=temperature == 0, top_k=top_k, top_p=top_p,
                        penalise=options.repetition_penalty is not None, ban_eos=min_new > 0,
                        logprobs=output_logprobs, verification=verification)
    extras = {"repetition_penalty": options.repetition_penalty, "min_new_tokens": min_new, "stop": stop,
              "on_tokens": None if streamer is None else streamer.put}

    start_time = time.perf_counter()
    bar = tqdm(total=batch * max_new_tokens, desc="specdec.generate", unit="tok", disable=not progress)
    use_static = (device.type == "cuda" or runner == "native") if static is None else static
    reason = _static_problem(verifier, drafter_facts) if use_static else None
    result = None
    try:
        if streamer is not None:
            streamer.put(prompt_ids.cpu())
        if use_static and reason is None:
            try:
                result = _decode_static(verifier, drafter, input_ids, attention_mask, max_new_tokens, draft_lengths,
                                        temperature, sampling, vocab, eos_ids, pad, backend, row_seeds, draft_seeds,
                                        bar.update, compile, extras,
                                        "hf" if runner == "hf" else "native")
            except _CaptureError as error:
                reason = str(error)
        if result is None:
            result = decode_eager(verifier, drafter, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                  draft_lengths=draft_lengths, greedy=temperature == 0, temperature=temperature,
                                  top_k=top_k, top_p=top_p, vocab=vocab, eos_ids=eos_ids, pad=pad, backend=backend,
                                  row_seeds=row_seeds, draft_seeds=draft_seeds, on_emit=bar.update,
                                  output_logprobs=output_logprobs, verification=verification,
                                  **extras)
    finally:
        bar.close()
        if streamer is not None:
            streamer.end()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall_time = time.perf_counter() - start_time
    path = "static" if use_static and reason is None else "eager"
    native_reason = _native_problem(verifier, drafter if max_drafts else None) if runner != "hf" else "hf"
    used_runner = "native" if path == "static" and native_reason is None else "hf"
    if runner == "native" and reason is None and native_reason is not None:
        reason = f"native runner not used: {native_reason}"
    if compile and path == "eager":
        warnings.warn("compile=True has no effect on the eager path (only the static path compiles its decoding "
                      f"step){': ' + reason if reason else ''}", SpecdecWarning, stacklevel=3)
    if compile and path == "static" and used_runner == "native":
        warnings.warn("compile=True has no effect on the native decode runner (its steps are fused kernels already); "
                      "runner='hf' compiles the models' HF forward instead", SpecdecWarning, stacklevel=3)
    generated = result.generated
    max_generated = int(generated.max())
    sequences = torch.cat([input_ids.to(torch.int64), result.tokens[:, :max_generated]], dim=1)
    counters = result.counters
    stats = SpecDecodeStats(
        drafted=counters["drafted"].cpu(), accepted=counters["accepted"].cpu(), generated=generated.cpu(),
        verifier_calls=counters["verifier_calls"].cpu(), drafter_calls=counters["drafter_calls"].cpu(),
        accepted_per_position=result.accepted_per_position[:, :max(max_drafts, 1)].cpu(),
        attempted_per_position=result.attempted_per_position[:, :max(max_drafts, 1)].cpu(),
        wall_time_s=wall_time, time_to_first_token_s=result.first_token_at - start_time, num_draft_tokens=max_drafts,
        draft_lengths=result.draft_lengths,
        path=path, fallback_reason=reason, setup_time_s=result.setup_seconds,
        compiled=compile and path == "static" and (runner == "hf" or native_reason is not None), runner=used_runner,
    )
    logprobs = None if result.logprobs is None else result.logprobs[:, :max_generated]
    return GenerateOutput(sequences=sequences, stats=stats, logprobs=logprobs)


def _warn_past_positions(verifier: torch.nn.Module, drafter: torch.nn.Module, prompt_len: int, max_new_tokens: int,
                         max_drafts: int) -> None:
    """SpecdecWarning when a row can reach past the positions the models were built for (a last round writes up to
    K drafts past the budget): models with learned position embeddings fail there, rotary ones drift."""

    positions = pair_positions(verifier, drafter)
    needed = prompt_len + max_new_tokens + max_drafts
    if positions is not None and needed > positions:
        warnings.warn(f"input_ids ({prompt_len} columns) + max_new_tokens={max_new_tokens} + up to {max_drafts} draft "
                      f"tokens need {needed} positions, more than the models' {positions} (max_position_embeddings): "
                      "models with learned position embeddings fail there and others leave what they were trained "
                      "on; shorten the prompt or max_new_tokens", SpecdecWarning, stacklevel=3)


def clear_static_caches() -> None:
    """Frees what the static path keeps between calls: per verifier, up to two engines of preallocated KV caches and
    captured CUDA graphs (one per batch size and cache-size bucket), so their GPU memory can be released."""
    clear_engines()


class _CaptureError(RuntimeError):
    """The static path could not set up its rounds for this model pair (the message is the one-line reason)."""


def _static_problem(verifier: torch.nn.Module, drafter: torch.nn.Module) -> str | None:
    """Why the static path cannot run this pair (the first model's reason), or None."""
    for name, model in (("verifier", verifier), ("drafter", drafter)):
        problem = fast_path_problem(model, name)
        if problem is not None:
            return problem
    return None


def _native_problem(verifier: torch.nn.Module, drafter: torch.nn.Module | NgramDrafter | None) -> str | None:
    """Why the native runner cannot run this pair (the first model's reason, named), or None. An n-gram drafter
    (no decoder) and a plain call (no drafter) leave the verifier alone."""
    for name, model in (("verifier", verifier), ("drafter", drafter)):
        problem = None if model is None or isinstance(model, NgramDrafter) else native_problem(model)
        if problem is not None:
            return f"{name}: {problem}"
    return None


def _decode_static(verifier, drafter, input_ids, attention_mask, max_new_tokens, draft_lengths, temperature,
                   sampling, vocab, eos_ids, pad, backend, row_seeds, draft_seeds, on_emit, compile_models,
                   extras, runner) -> DecodeResult:
    """Runs the static path; a failure while building or capturing its rounds becomes a :class:`_CaptureError`."""
    batch, prompt_len = input_ids.shape
    max_drafts = max(draft_lengths)
    device = input_ids.device
    setup_start = time.perf_counter()
    try:
        engine = get_engine(verifier, drafter, batch, prompt_len + max_new_tokens + max_drafts + 1, vocab,
                            max_drafts, len(eos_ids), device, backend, device.type == "cuda", compile_models, runner)
        controller = engine.prepare(draft_lengths, sampling)
    except (RuntimeError, TypeError, ValueError, AttributeError, NotImplementedError) as error:
        clear_engines(verifier)
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise _CaptureError(f"static path unavailable ({type(error).__name__}: {first_line})") from error
    setup_seconds = time.perf_counter() - setup_start  # engine, captures and round timing (about 0 when reused)
    result = decode_static(engine, controller, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                           draft_lengths=draft_lengths, sampling=sampling, temperature=temperature, eos_ids=eos_ids,
                           pad=pad, row_seeds=row_seeds, draft_seeds=draft_seeds, on_emit=on_emit, **extras)
    result.setup_seconds = setup_seconds
    return result
