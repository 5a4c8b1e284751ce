"""Inference over the model package: the searches (greedy, sampling, beam search) over a
model-agnostic callback, the logits processors, prompt packing and `generate` (batches of
prompts through a compiled decode)."""
