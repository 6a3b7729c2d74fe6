"""Text: a model's tokenizer and chat template from its GGUF file, with no transformers.

`gguf_metadata` reads a GGUF file's metadata; `pre_tokenizers` names how each byte-level
vocabulary cuts text; `gguf_tokenizer` builds the tokenizer (on Hugging Face's
`tokenizers`); `chat_template` renders a template as transformers does; `chat_tokens`
turns a conversation into ids with the template's markup its only control tokens. Used by
the daemon's engine and, offline, by `kvgraft tokenize` / `detokenize`.
"""
