"""What a request asks its output to match (no torch): see engine/grammar.py for the matching."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    EBNF = "ebnf"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: GrammarKind
    text: str = ""  # the schema (JSON text), regex or EBNF grammar; empty for JSON_OBJECT
