"""`transformer_jax.decoding` as users import it (DESIGN.md's public interface: `beam_search`,
greedy and sampling over a `tokens_to_logits` callback): the searches moved to
transformer_jax/inference/, and importing this name gives inference/decoding.py itself, which
re-exports beam search and the logits processors."""

import sys

from transformer_jax.inference import decoding as _moved

sys.modules[__name__] = _moved
