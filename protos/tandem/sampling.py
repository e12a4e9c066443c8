"""A request's sampling settings as one record, from the gateway's routes to the engine. Standard library
only, so that both sides may import it: the gateway builds a `SamplingSpec` and sends it as
`tandem.v1.SamplingParams`; a worker reads the same record back and the engine resolves its defaults
(`engine.request.SamplingParams.from_spec`). The ranges live in `tandem.limits`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields


class GrammarKind(enum.Enum):
    """What an output constraint is written in; the value is the member's name in the proto's `constraint` oneof."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    EBNF = "ebnf"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request asks its output to match (see engine/grammar.py for the matching)."""

    kind: GrammarKind
    text: str = ""  # the schema (JSON text), regex or EBNF grammar; empty for JSON_OBJECT


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How to choose the next tokens, as a request asked. A field left None (or empty) is unset and takes
    the server's default, never zero; the meaning and default of each field is documented on
    `tandem.v1.SamplingParams`, whose fields these are, by name."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool | None = None
    min_new_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a later pair for one id wins
    top_logprobs_num: int | None = None
    token_ids_logprob: tuple[int, ...] = ()
    grammar: GrammarSpec | None = None  # the proto's `constraint` oneof


REPEATED_FIELDS = ("stop_token_ids", "logit_bias", "token_ids_logprob")
# The rest but `grammar`: each an `optional` scalar of tandem.v1.SamplingParams of the same name.
SCALAR_FIELDS = tuple(f.name for f in fields(SamplingSpec) if f.name not in REPEATED_FIELDS and f.name != "grammar")
