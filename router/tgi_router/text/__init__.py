"""Text: the tokenizer (tokenizers' Rust library, no transformers),
incremental detokenization, stop strings, grammars (JSON schema and regex
into llguidance's form), the tokens-per-character bound that refuses an
oversized input before tokenizing it, and reasoning markers (<think>).

May import: tgi_router.errors. Nothing else of the router."""
