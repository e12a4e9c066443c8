"""OpenAI response pieces: logprobs in chat and completions shapes, usage, finish fields."""

from __future__ import annotations

from gateway.service.generation import GenerationResult
from gateway.records import GeneratedToken
from gateway.text.tokenizer import Tokenizer


def chat_logprobs(tokenizer: Tokenizer, tokens: list[GeneratedToken], num_top: int) -> dict:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}` for these tokens."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in t.top[:num_top]]} for t in tokens]}


def completion_logprobs(tokenizer: Tokenizer, tokens: list[GeneratedToken], num_top: int, text_offset: int) -> dict:
    """Legacy completions shape: parallel lists of tokens, logprobs, top dicts and text offsets."""
    texts = [tokenizer.decode([t.token_id], skip_special_tokens=False) for t in tokens]
    offsets, position = [], text_offset
    for text in texts:
        offsets.append(position)
        position += len(text)
    return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{tokenizer.decode([i], skip_special_tokens=False): lp for i, lp in t.top[:num_top]}
                             for t in tokens],
            "text_offset": offsets}


def prompt_completion_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], scored: list[GeneratedToken],
                               num_top: int) -> dict:
    """The echoed prompt's part of the legacy shape (`echo` with `logprobs`): the first token has no
    logprob (None, and None for its top dict); the others come from the prefill server's scoring."""
    first = GeneratedToken(prompt_ids[0], 0.0)
    part = completion_logprobs(tokenizer, [first, *scored], num_top, 0)
    part["token_logprobs"][0] = None
    part["top_logprobs"][0] = None
    return part


def join_completion_logprobs(head: dict, tail: dict) -> dict:
    return {key: head[key] + tail[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def finish_name(result: GenerationResult) -> str | None:
    return result.finish.reason if result.finish is not None else None


def matched_stop(result: GenerationResult):
    return result.finish.matched if result.finish is not None else None


def usage(prompt_tokens: int, results: list[GenerationResult], choices_per_prompt: int = 1) -> dict:
    """`prompt_tokens` counts each prompt once (its n choices share it); completion tokens add up
    over every choice. `cached_tokens` are the prefill server's prefix-cache hits for each prompt's
    first choice, so they never exceed `prompt_tokens`."""
    completion = sum(len(r.output_ids) for r in results)
    firsts = results[::choices_per_prompt]
    cached = sum(r.timings.cached_tokens for r in firsts if r.timings is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": min(cached, prompt_tokens)}}
