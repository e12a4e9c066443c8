"""Grammar-constrained decoding: JSON schema, any JSON object, regex, EBNF (xgrammar).

Each constrained request holds a matcher that tracks what it has generated; before sampling, its
row of logits is masked to the tokens the grammar allows next. xgrammar and the tokenizer (for the
vocabulary's byte strings) load on the first constrained request, so unconstrained serving never
pays for them. The most recently used compiled grammars are cached by spec (`CACHE_SIZE`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.outputs import accept_token
from tandem.converted_tokenizer import load_hf_tokenizer
from tandem.sampling import GrammarKind, GrammarSpec

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept: a flood of distinct schemas cannot grow memory without bound


class GrammarBackend:
    """Compiles specs into per-request matchers and masks logits with them.

    Engine thread only: `lookup`, `store`, `prepare`, `new_matcher`, `mask_logits` (the cache of
    compiled grammars is touched there alone). `load` and `compile` may run on another thread, one
    call at a time, and never touch the cache: the server runtime compiles a request's grammar
    there and hands the result to the engine thread with `store` before submitting the request, so
    loading the tokenizer or compiling a large schema never stalls running requests.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()

    def load(self) -> None:
        """Load the tokenizer's vocabulary and the compiler (once; the first constrained request)."""
        self._ensure_compiler()

    def compile(self, spec: GrammarSpec) -> Any:
        """`spec` compiled (loading the compiler first if need be), never cached; an invalid schema,
        regex or grammar raises InvalidRequestError."""
        compiler = self._ensure_compiler()
        try:
            if spec.kind is GrammarKind.JSON_SCHEMA:
                return compiler.compile_json_schema(spec.text)
            if spec.kind is GrammarKind.JSON_OBJECT:  # OpenAI's json_object: an object, not any JSON value
                return compiler.compile_json_schema('{"type": "object"}')
            if spec.kind is GrammarKind.REGEX:
                return compiler.compile_regex(spec.text)
            return compiler.compile_grammar(spec.text)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the parse error
            raise InvalidRequestError(f"invalid {spec.kind.value}: {exc}") from None

    def lookup(self, spec: GrammarSpec) -> Any | None:
        """The cached compile of `spec` (now the most recently used), or None."""
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
        return compiled

    def store(self, spec: GrammarSpec, compiled: Any) -> None:
        """Cache `compiled` (from `compile(spec)`) as the most recently used; the least recently used
        beyond `CACHE_SIZE` are dropped."""
        self._compiled[spec] = compiled
        self._compiled.move_to_end(spec)
        while len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)

    def prepare(self, spec: GrammarSpec) -> Any:
        """The compiled `spec`, from the cache or compiled into it here."""
        compiled = self.lookup(spec)
        if compiled is None:
            compiled = self.compile(spec)
            self.store(spec, compiled)
        return compiled

    def new_matcher(self, spec: GrammarSpec) -> Any:
        """A fresh matcher for `spec` (compiled here if `prepare` was not called first)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.prepare(spec))

    def mask_logits(
        self, logits: torch.Tensor, matchers: list[Any], drafts: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Return `logits` ([R, V] fp32, any device) with each constrained row limited to its grammar's
        next tokens. Request i (matcher `matchers[i]`, None: unconstrained) owns `len(drafts[i]) + 1`
        consecutive rows (one without `drafts`): row j is masked for the state after its first j draft
        tokens, which the grammar must accept (the scheduler keeps only such drafts); each matcher is
        rolled back to where it was. The matchers fill a host bitmask, applied on the logits' device."""
        import xgrammar

        drafts = drafts or [[] for _ in matchers]
        firsts = [0, *accumulate(len(d) + 1 for d in drafts)]
        rows = [row for i, m in enumerate(matchers) if m is not None for row in range(firsts[i], firsts[i + 1])]
        if not rows:
            return logits
        bitmask = xgrammar.allocate_token_bitmask(len(rows), self._vocab_size)
        slot = 0
        for matcher, request_drafts in zip(matchers, drafts):
            if matcher is None:
                continue
            for j in range(len(request_drafts) + 1):
                matcher.fill_next_token_bitmask(bitmask, slot)
                slot += 1
                if j < len(request_drafts):
                    accept_token(matcher, request_drafts[j])
            if request_drafts:
                matcher.rollback(len(request_drafts))
        constrained = logits[rows].contiguous()
        xgrammar.apply_token_bitmask_inplace(constrained, bitmask.to(logits.device))
        logits = logits.clone()
        logits[rows] = constrained
        return logits

    def _ensure_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(
                _load_hf_tokenizer(self._tokenizer_path), vocab_size=self._vocab_size
            )
            self._compiler = xgrammar.GrammarCompiler(info)
            logger.info("grammar backend ready (xgrammar, vocabulary %d)", self._vocab_size)
        return self._compiler


def _load_hf_tokenizer(path: str) -> Any:
    """The model's transformers tokenizer; a GGUF file's through the converted copy the gateway keeps too
    (converting SmolLM2's vocabulary took 13 s on a worker's first constrained request)."""
    model = Path(path)
    if model.is_file() and model.suffix == ".gguf":
        return load_hf_tokenizer(str(model.parent), model.name)
    return load_hf_tokenizer(str(model), None)
