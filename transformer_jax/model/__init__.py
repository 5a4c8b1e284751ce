"""The Flax model and nothing else: the schema of its fields (schema.py), layers, blocks, the
three models, LoRA adapters, attention (the module, the reference einsums, the kernel table,
beam attention) and the decoding KV cache's layout. This package imports nothing else of the
project (tests/test_architecture.py checks it)."""
