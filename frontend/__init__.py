"""The HTTP process: OpenAI API, tokenizer and chat template, detokenization, stop strings, metrics."""
