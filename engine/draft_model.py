"""The draft-model proposer: a smaller model of the same tokenizer guesses each request's next tokens
(`--speculative-algorithm draft`, `--speculative-draft-model-path`), and `proposer_for`, which builds
the proposer an engine's settings ask for.

The draft model runs in its own `ModelRunner`, with a paged KV pool beside the target's and as many
tokens deep, and keeps a KV sequence per decoding request. A step's asks run as one batch per draft
position: the first pass feeds each request what its draft KV lacks (the whole prompt the first time,
built here on the decode worker; after a step, the accepted drafts and the target's own token), every
later pass feeds the draft just chosen. A draft is the draft model's argmax, a fixed guess, so the
target's verification keeps its own distribution exactly. What the target rejected is overwritten: a
sequence's KV is cut back to the longest prefix it shares with the request's tokens before each step.
A step feeds at most `catch_up_tokens` of prompts beyond the decoding requests' few tokens: a longer
prompt is caught up over several steps, drafting nothing until it is. While other requests decode
beside it, the decode pacer gives the catch-up a time (its allowance) and the proposer
feeds what fits, at its measured seconds per catch-up token, so the others keep their pace.

A request's draft KV goes when it stops decoding here (`forget`); when the draft pool runs short,
the sequences of requests that ask nothing this step go first, and a request that still finds no
room gets no drafts that step.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import torch

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.page_allocator import PageAllocator, pages_needed
from engine.proposers import DraftAsk, NgramProposer, Proposer
from engine.runner import ModelRunner
from engine.weights import Checkpoint

_EMA_WEIGHT = 0.2  # of a new step's seconds per draft (or per catch-up token) in their moving average


def proposer_for(
    config: EngineConfig,
    draft: Checkpoint | None,
    target: ModelConfig,
    context_len: int,
    num_pages: int,
    progress: bool = False,
) -> Proposer | None:
    """The proposer `config.speculative_algorithm` names (None: no speculation); "draft" runs the
    `draft` checkpoint, which only it may be given."""
    algorithm = config.speculative_algorithm
    if (algorithm == "draft") != (draft is not None):
        raise ConfigError(
            "speculative algorithm 'draft' needs a draft model (--speculative-draft-model-path)"
            if algorithm == "draft"
            else f"a draft model is run only by speculative algorithm 'draft', not {algorithm!r}"
        )
    if algorithm == "ngram":
        return NgramProposer(config.speculative_num_draft_tokens)
    if draft is not None:
        return DraftModelProposer(draft, config, target, context_len, num_pages, progress)
    return None


@dataclass(slots=True)
class _DraftSequence:
    """One request's tokens whose KV the draft pool holds, and the pages holding it."""

    token_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    """Drafts from a smaller model's greedy continuation (see the module docstring)."""

    # Prompt tokens a step feeds the draft model beyond the decoding requests' few: a new request's
    # prompt is caught up in chunks of this (no drafts until it is), so its streams' step grows by a
    # bounded draft prefill rather than by the whole prompt's.
    catch_up_tokens = 256
    first_paced_tokens = 16  # a paced catch-up's first chunk, before its cost per token is measured
    min_paced_tokens = 8

    def __init__(
        self,
        checkpoint: Checkpoint,
        config: EngineConfig,
        target: ModelConfig,
        context_len: int,
        num_pages: int,
        progress: bool = False,
    ) -> None:
        mc = checkpoint.config
        if mc.vocab_size != target.vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary ({mc.vocab_size} tokens) is not the target's ({target.vocab_size}): "
                "a draft model must share the target's tokenizer"
            )
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.page_size = config.page_size
        self.context_len = min(context_len, mc.max_position_embeddings)
        # the target's device, dtype and quantization; as many pages as its pool; no adapter, no CUDA graph
        pool = replace(config, max_total_tokens=num_pages * config.page_size, max_loras=0, cuda_graph_batch_sizes=())
        self.runner = ModelRunner(checkpoint, pool, self.context_len, progress=progress)
        self.allocator = PageAllocator(self.runner.kv_pool.num_pages)
        self._sequences: dict[str, _DraftSequence] = {}
        self._seconds_per_draft = 0.0
        self.seconds_per_catch_up_token = 0.0  # measured on the passes that catch a prompt up (0: none yet)

    @property
    def seconds_per_draft(self) -> float:
        return self._seconds_per_draft

    @property
    def runs_model(self) -> bool:
        return True

    @property
    def num_sequences(self) -> int:
        """Requests whose draft KV the pool holds."""
        return len(self._sequences)

    def forget(self, request_id: str) -> None:
        seq = self._sequences.pop(request_id, None)
        if seq is not None:
            self.allocator.free(seq.page_ids)

    @torch.inference_mode()
    def propose(self, asks: Sequence[DraftAsk], catch_up_s: float | None = None) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in asks]
        asking = {ask.request_id for ask in asks}
        catch_up_left = self.catch_up_budget(catch_up_s)
        # (ask index, its sequence, the tokens to feed next, the drafts it wants: 0 while catching up)
        live: list[tuple[int, _DraftSequence, list[int], int]] = []
        for i, ask in enumerate(asks):
            token_ids = ask.token_ids
            num_tokens = len(token_ids)
            wanted = min(ask.max_tokens, self.num_draft_tokens, self.context_len - num_tokens)
            if wanted <= 0 or num_tokens == 0:
                continue
            seq = self._sequences.setdefault(ask.request_id, _DraftSequence())
            # the last token is always fed: its logits give the first draft
            num_kept = min(_common_prefix_len(seq.token_ids, token_ids), num_tokens - 1)
            feed = token_ids[num_kept:]
            if len(feed) > max(catch_up_left, self.num_draft_tokens + 1):  # a chunk of a prompt, no drafts yet
                feed, wanted = feed[: max(catch_up_left, 0)], 0
                if not feed:
                    continue
            catch_up_left -= len(feed)
            if not self._hold_pages(seq, num_kept + len(feed) + max(wanted - 1, 0), asking):
                continue
            del seq.token_ids[num_kept:]
            live.append((i, seq, feed, wanted))
        while live:
            started = time.perf_counter()
            next_ids = self._forward_argmax(live)
            still: list[tuple[int, _DraftSequence, list[int], int]] = []
            for (i, seq, feed, wanted), token_id in zip(live, next_ids):
                seq.token_ids.extend(feed)
                if len(drafts[i]) < wanted:
                    drafts[i].append(token_id)
                if len(drafts[i]) < wanted:
                    still.append((i, seq, [token_id], wanted))
            seconds = time.perf_counter() - started
            if all(len(feed) <= self.num_draft_tokens + 1 and wanted for _, _, feed, wanted in live):
                self._seconds_per_draft = _averaged(self._seconds_per_draft, seconds / len(live))
            else:  # a catch-up's pass is no draft's cost; its rows are all counted as catch-up
                per_token = seconds / sum(len(feed) for _, _, feed, _ in live)
                self.seconds_per_catch_up_token = _averaged(self.seconds_per_catch_up_token, per_token)
            live = still
        return drafts

    def catch_up_budget(self, catch_up_s: float | None) -> int:
        """Prompt tokens a step may catch up: `catch_up_tokens`, or with a time to keep, what fits in it
        at the measured seconds per token (`first_paced_tokens` before any is measured), at least
        `min_paced_tokens`: a request's tokens grow by one or more a step, and its catch-up must gain
        on them."""
        if catch_up_s is None:
            return self.catch_up_tokens
        fitting = (
            int(catch_up_s / self.seconds_per_catch_up_token)
            if self.seconds_per_catch_up_token
            else self.first_paced_tokens
        )
        return min(max(fitting, self.min_paced_tokens), self.catch_up_tokens)

    def _forward_argmax(self, live: Sequence[tuple[int, _DraftSequence, list[int], int]]) -> list[int]:
        """One draft-model pass feeding each live sequence its tokens (KV written after its kept
        ones); each one's greedy next token."""
        logits = self.runner.forward_paged(
            [feed for _, _, feed, _ in live],
            [len(seq.token_ids) for _, seq, _, _ in live],
            [seq.page_ids for _, seq, _, _ in live],
        )
        return logits.argmax(dim=-1).tolist()

    def _hold_pages(self, seq: _DraftSequence, num_tokens: int, asking: Collection[str]) -> bool:
        """Give `seq` pages for `num_tokens` tokens, evicting the sequences of requests not in
        `asking` if the pool runs short; False when there is still no room (its pages are kept)."""
        extra = pages_needed(num_tokens, self.page_size) - len(seq.page_ids)
        if extra <= 0:
            return True
        for request_id in [r for r in self._sequences if r not in asking]:
            if self.allocator.can_allocate(extra):
                break
            self.allocator.free(self._sequences.pop(request_id).page_ids)
        if not self.allocator.can_allocate(extra):
            return False
        seq.page_ids.extend(self.allocator.allocate(extra))
        return True


def _averaged(old: float, new: float) -> float:
    """A moving average's next value (the first measurement as it is)."""
    return new if old == 0 else old + _EMA_WEIGHT * (new - old)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share (list slices compared at C speed, bisected)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n - 1  # a[:low] == b[:low] and a[:high + 1] != b[:high + 1]
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
