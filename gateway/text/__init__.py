"""Text in and out: tokenizer, chat-template input, detokenizer, stop strings, reasoning, tool calls."""
