"""Choosing each sequence's next token from its logits row, batched: the
sampler (TGI's HeterogeneousNextTokenChooser), its per-request parameters,
penalties, top-k / top-p / typical-p / min-p warpers over blocks of the
vocabulary, the green-list watermark and its detector, and grammars
(llguidance masks, and the budgets that let a constrained sequence finish
within max_new_tokens). Only rank 0 samples.

May import: tgi_kernels (its CPU vocabulary kernels), tgi_proto, and for the
detector's command model_loader and weights (a checkpoint's tokenizer and
config); never the model runner, layers or models."""
