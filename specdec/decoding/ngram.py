"""The model-free n-gram (prompt-lookup) drafter: ``specdec.ngram_drafter()`` or ``drafter="ngram"``.

Proposal rule. A row's *tokens* are its prompt and generated tokens in order, padding left out (the slots whose
attention mask is 0: left padding, the holes the eager path leaves for rejected drafts). With ``t`` the row's
tokens and ``L`` their count, for ``n = max_ngram, max_ngram - 1, ..., min_ngram`` the drafter looks for the most
recent earlier occurrence of the last ``n`` tokens, the largest ``i`` with ``i + n < L`` and
``t[i : i + n] == t[L - n : L]``, and proposes the token that followed it, ``t[i + n]``; the first ``n`` that
matches decides. With no match it proposes the last token ``t[L - 1]`` (a fixed fallback, so that every call has the
same shape). K drafts are K such proposals, each made on the tokens extended by the drafts before it, so a matched
continuation is copied token by token (as Hugging Face's prompt lookup and vLLM's ngram proposer copy the tokens
after a match).

Losslessness. A proposal is a deterministic function of the tokens, so the drafter's law is one-hot:
``q(x) = 1`` at the draft and 0 elsewhere. The drafter hands the round *logits* ``0`` at the draft and ``-inf``
elsewhere (:func:`one_hot_logits`), whose softmax is that q at every temperature and which top-k / top-p filtering
leaves as they are; the rejection sampler then accepts draft ``x`` with probability ``min(1, p(x) / q(x)) = p(x)``
and after a rejection draws from ``max(0, p - q)`` normalised, which is ``p`` without ``x``: exactly the verifier's
law. Greedy rounds accept a draft iff it is the verifier's arg-max.

Where it runs. :class:`NgramSlot` (static path: a ``[B, S + 1]`` token table written inside the captured round,
fixed-shape tensor ops, no host synchronisation) and :class:`NgramRunner` (eager path) serve the same calls as a
drafter model's slot or runner, and :func:`prefix_proposals` gives the proposal after every prefix of a batch of
texts for the teacher-forced measurements of :mod:`specdec.fairness`.

Tokens are kept *compacted*: a token goes to the column given by its rope position (``cumsum(mask) - 1`` over the
prompt, one more per generated token), which both decoding paths already track, and padding goes to a spare last
column that is never read. So both paths hold the same table for the same row and make the same proposals, and
a rejected draft is overwritten by the token that replaces it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from specdec._validation import check_int_at_least, use_triton
from specdec.decoding.timing import capture_graph, median_seconds
from specdec.kernels.ngram_propose import ngram_propose_triton
from specdec.kernels.ngram_propose_reference import ngram_propose

NGRAM = "ngram"  # the ``drafter`` shorthand for ``ngram_drafter()``
PREFIX_CHUNK = 256  # prefixes per block in :func:`prefix_proposals` (bounds its [B, chunk, L] match tables)


@dataclass(frozen=True, eq=False)
class NgramDrafter:
    """A model-free drafter for :func:`specdec.generate` (see :func:`ngram_drafter`); compared by identity, so the
    static path's engines (caches, captured rounds) are reused for the same object."""

    max_ngram: int = 3
    min_ngram: int = 1

    def __repr__(self) -> str:
        return f"ngram_drafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"


_DRAFTERS: dict[tuple[int, int], NgramDrafter] = {}


def ngram_drafter(max_ngram: int = 3, min_ngram: int = 1) -> NgramDrafter:
    """A model-free n-gram (prompt-lookup) drafter, usable wherever :func:`specdec.generate` takes a drafter model.

    Each draft is the token that followed the most recent earlier occurrence of the row's last ``n`` tokens (prompt
    and generated tokens, padding left out), for the largest ``n`` in ``[min_ngram, max_ngram]`` that occurs; with
    none, the row's last token. The drafter's law is one-hot at its draft, so rejection sampling accepts draft ``x``
    with probability ``p(x)`` (greedy: iff ``x`` is the verifier's arg-max) and stays exactly lossless.

    Parameters
    ----------
    max_ngram : int
        Longest suffix matched (>= 1). Longer matches are tried first; the proposal costs
        ``O(max_ngram^2)`` comparisons per context token.
    min_ngram : int
        Shortest suffix matched (``1 <= min_ngram <= max_ngram``).

    Returns
    -------
    NgramDrafter
        The same object for the same arguments (so captured rounds are reused across calls). ``drafter="ngram"``
        in :func:`specdec.generate` and :func:`specdec.evaluate` means ``ngram_drafter()``.

    Notes
    -----
    It runs on the static path (the proposal is captured in the round's CUDA graph) and on the eager path, with any K
    and with ``num_draft_tokens="auto"`` (whose round-time model then sees a drafter that costs about nothing).
    ``stats.drafter_calls`` counts proposals as it counts a drafter model's forward calls.

    Examples
    --------
    >>> out = specdec.generate(verifier, specdec.ngram_drafter(max_ngram=4), input_ids, num_draft_tokens="auto")
    """
    max_ngram = check_int_at_least(max_ngram, "max_ngram", 1)
    min_ngram = check_int_at_least(min_ngram, "min_ngram", 1)
    if min_ngram > max_ngram:
        raise ValueError(f"min_ngram must be <= max_ngram, got min_ngram={min_ngram} > max_ngram={max_ngram}")
    key = (max_ngram, min_ngram)
    if key not in _DRAFTERS:
        _DRAFTERS[key] = NgramDrafter(max_ngram, min_ngram)
    return _DRAFTERS[key]


def as_ngram_drafter(drafter: object) -> NgramDrafter | None:
    """The :class:`NgramDrafter` that ``drafter`` names (itself, or ``ngram_drafter()`` for ``"ngram"``), or None
    for anything else (a drafter model); TypeError for any other string."""
    if isinstance(drafter, NgramDrafter):
        return drafter
    if isinstance(drafter, str):
        if drafter != NGRAM:
            raise TypeError(f"drafter must be a causal LM, specdec.ngram_drafter(...) or 'ngram', got {drafter!r}")
        return ngram_drafter()
    return None


def drafter_model(verifier: torch.nn.Module, drafter: object) -> object:
    """The model whose device, vocabulary and positions the drafter has: the verifier for an n-gram drafter (it has
    none of its own), else the drafter itself. Argument checks meant for a drafter model take this one."""
    return verifier if as_ngram_drafter(drafter) is not None else drafter


# ----------------------------------------------------------------------------------------------------- the rule
def one_hot_logits(proposals: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of the one-hot law at ``proposals`` [...] int64 in [0, vocab): [..., vocab] of ``dtype``, 0 at the
    proposal and ``-inf`` elsewhere (softmax: 1 at the proposal at every temperature; arg-max: the proposal)."""
    logits = torch.full((*proposals.shape, vocab), float("-inf"), dtype=dtype, device=proposals.device)
    return logits.scatter_(-1, proposals[..., None], 0.0)


def write_tokens(table: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                 real: torch.Tensor) -> None:
    """Writes a call's tokens into a compacted token table, in place.

    ``table`` [B, N + 1] int64 (column N takes padding and is never read), ``lengths`` [B] int64, ``ids`` and
    ``positions`` [B, T] int64 (positions in [0, N), increasing over a row's real tokens), ``real`` [B, T] bool.
    Real tokens go to their positions; a row with a real token gets ``lengths`` = its last position + 1 (the tokens a
    proposal after this call sees), a row without keeps its length."""
    spare = table.shape[1] - 1
    table.scatter_(1, torch.where(real, positions, spare), ids)
    last = torch.where(real, positions + 1, 0).amax(dim=1)
    lengths.copy_(torch.where(real.any(dim=1), last, lengths))


# ----------------------------------------------------------------------------------------------------- static path
class NgramSlot:
    """The n-gram drafter on the static path, with a drafter model slot's contract:
    ``forward(ids [B, T] int64, slots [B, T] int64, keep) -> [B, keep, V]`` float32 one-hot logits.

    ``key_ok`` [B, S] bool (False at prompt padding) and ``slot_positions`` [B, S] int64 are the engine's tensors
    (refilled in place for each call). Each call writes its tokens into ``table`` at their positions and proposes the
    token after each of its last ``keep`` slots; every operation has a fixed shape, so the call is captured in the
    round's CUDA graph. ``use_kernels``: the proposal as one Triton launch, else :func:`ngram_propose` (the engine
    passes its backend's choice).
    """

    def __init__(self, drafter: NgramDrafter, batch: int, capacity: int, vocab: int, key_ok: torch.Tensor,
                 slot_positions: torch.Tensor, *, use_kernels: bool = False):
        self.model = weakref.ref(drafter)  # (the engine's identity check reads it as it reads a model slot's)
        self.max_ngram, self.min_ngram = drafter.max_ngram, drafter.min_ngram
        self.vocab = vocab
        self.key_ok, self.slot_positions = key_ok, slot_positions
        device = key_ok.device
        self.propose = ngram_propose_triton if use_kernels else ngram_propose
        self.table = torch.zeros((batch, capacity + 1), dtype=torch.int64, device=device)  # [B, S + 1] tokens
        self.lengths = torch.ones(batch, dtype=torch.int64, device=device)  # [B] tokens of the last call's context

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, keep: int, eager: bool = False) -> torch.Tensor:
        positions = self.slot_positions.gather(1, slots)
        write_tokens(self.table, self.lengths, ids, positions, self.key_ok.gather(1, slots))
        tokens = self.table[:, :-1]
        proposals = [self.propose(tokens, positions[:, j] + 1, self.max_ngram, self.min_ngram)
                     for j in range(ids.shape[1] - keep, ids.shape[1])]
        return one_hot_logits(torch.stack(proposals, dim=1), self.vocab)


# ----------------------------------------------------------------------------------------------------- eager path
class NgramRunner:
    """The n-gram drafter on the eager path, with a drafter model runner's calls: ``forward(input_ids [B, T],
    attention_mask [B, end], position_ids [B, T], num_logits) -> [B, num_logits, V]`` float32 one-hot logits for the
    slots ``end - T .. end - 1`` of the shared layout, ``crop`` and ``length``.

    Tokens are written at their positions, so the holes the eager path leaves (mask 0) are skipped and a rejected
    draft is overwritten by the token after the row's accepted ones; re-reading slots after a crop rewrites the same
    tokens."""

    def __init__(self, drafter: NgramDrafter, vocab: int):
        self.max_ngram, self.min_ngram = drafter.max_ngram, drafter.min_ngram
        self.vocab = vocab
        self.table: torch.Tensor | None = None  # [B, N + 1] int64, grown with the layout
        self.lengths: torch.Tensor | None = None  # [B] int64
        self.length = 0  # slots of the shared layout read

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                num_logits: int) -> torch.Tensor:
        batch, new = input_ids.shape
        end = attention_mask.shape[1]
        if self.table is None or self.table.shape[1] <= end:  # positions stay below the slots of the layout
            grown = torch.zeros((batch, 2 * end + 1), dtype=torch.int64, device=input_ids.device)
            if self.table is not None:
                grown[:, : self.table.shape[1] - 1] = self.table[:, :-1]
            self.table = grown
        if self.lengths is None:
            self.lengths = torch.ones(batch, dtype=torch.int64, device=input_ids.device)
        real = attention_mask[:, end - new:] > 0
        write_tokens(self.table, self.lengths, input_ids, position_ids, real)
        self.length = end
        tokens = self.table[:, :-1]
        proposals = [ngram_propose(tokens, position_ids[:, j] + 1, self.max_ngram, self.min_ngram)
                     for j in range(new - num_logits, new)]
        return one_hot_logits(torch.stack(proposals, dim=1), self.vocab)

    def crop(self, new_length: int) -> None:
        self.length = min(self.length, new_length)


# ----------------------------------------------------------------------------------------------------- all prefixes
def prefix_proposals(input_ids: torch.Tensor, attention_mask: torch.Tensor, max_ngram: int,
                     min_ngram: int) -> torch.Tensor:
    """The proposal after every prefix of a right-padded batch (teacher forcing): [B, L] int64, entry ``[b, t]``
    equal to :func:`ngram_propose` on ``input_ids[b, : t + 1]`` (entries at padding are meaningless).

    ``input_ids``, ``attention_mask``: [B, L] int64, each row's real tokens first. Works in blocks of
    :data:`PREFIX_CHUNK` prefixes: ``run[b, t, j]`` counts how many tokens ending at ``t`` and at ``j`` agree
    backwards (up to ``max_ngram``), and the proposal is ``t[j + 1]`` for the largest ``j < t`` whose run reaches the
    longest ``n`` that any ``j`` reaches (``n >= min_ngram``; the last token when none does)."""
    batch, width = input_ids.shape
    device = input_ids.device
    real = attention_mask > 0
    tokens = torch.where(real, input_ids, -1)  # padding never equals a token
    ends = torch.arange(width, device=device)  # [L] the last index j of a candidate occurrence
    out = torch.empty((batch, width), dtype=torch.int64, device=device)
    for low in range(0, width, PREFIX_CHUNK):
        rows = torch.arange(low, min(low + PREFIX_CHUNK, width), device=device)  # [C] prefix ends t
        run = torch.ones((batch, rows.numel(), width), dtype=torch.bool, device=device)  # [B, C, L]
        best = torch.full((batch, rows.numel()), -1, dtype=torch.int64, device=device)  # [B, C] chosen j
        found = torch.zeros((batch, rows.numel()), dtype=torch.bool, device=device)
        matches = []
        for k in range(max_ngram):  # run_k: t - k and j - k agree too
            t_k, j_k = rows - k, ends - k
            agree = tokens[:, t_k.clamp(min=0)][:, :, None] == tokens[:, j_k.clamp(min=0)][:, None, :]
            run = run & agree & (t_k >= 0)[None, :, None] & (j_k >= 0)[None, None, :]
            matches.append(run)
        earlier = ends[None, None, :] < rows[None, :, None]  # j < t: the follower t[j + 1] is in the prefix
        for n in range(max_ngram, min_ngram - 1, -1):
            last = torch.where(matches[n - 1] & earlier, ends, -1).amax(dim=2)  # [B, C]
            take = (last >= 0) & ~found
            best = torch.where(take, last, best)
            found = found | take
        follower = input_ids.gather(1, (best + 1).clamp(max=width - 1))
        out[:, low: low + rows.numel()] = torch.where(found, follower, input_ids[:, rows])
    return out


def ngram_step_seconds(drafter: NgramDrafter, batch: int, context: int, vocab: int, device: torch.device,
                       repeats: int = 10) -> float:
    """Median seconds of one n-gram proposal step (a one-token :class:`NgramSlot` call over ``context`` tokens, the
    drafter's step on the static path), on a CUDA graph replay on CUDA (as the static path runs it), else a plain
    call; the cost ratio c of :func:`specdec.fairness.measure_decode_costs` for an n-gram drafter."""
    generator = torch.Generator().manual_seed(0)
    capacity = context + 1
    key_ok = torch.ones((batch, capacity), dtype=torch.bool, device=device)
    positions = torch.arange(capacity, device=device).expand(batch, capacity).contiguous()
    slot = NgramSlot(drafter, batch, capacity, vocab, key_ok, positions, use_kernels=use_triton("auto", device))
    prompt = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
    slot.forward(prompt, positions[:, :context], 1)
    ids, slots = prompt[:, -1:].clone(), positions[:, context - 1: context].clone()

    def call() -> None:
        slot.forward(ids, slots, 1)

    step = capture_graph(call, device) if device.type == "cuda" else call
    return median_seconds(step, device, repeats)


def prefix_logits(drafter: NgramDrafter, input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The n-gram drafter's teacher-forced logits: [N, vocab] one-hot rows (:func:`one_hot_logits`) at the proposal
    after every prefix with an observed next token of the right-padded batch ``input_ids`` [B, L], in the row order
    of :func:`specdec.fairness.teacher_forcing.prefix_logits` (position t of row b where ``attention_mask[b, t]`` and
    ``attention_mask[b, t + 1]`` are 1)."""
    proposals = prefix_proposals(input_ids, attention_mask, drafter.max_ngram, drafter.min_ngram)
    valid = (attention_mask[:, :-1] > 0) & (attention_mask[:, 1:] > 0)
    return one_hot_logits(proposals[:, :-1][valid], vocab, dtype)
