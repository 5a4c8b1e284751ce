"""Multi30k English -> German on one GPU: configs/multi30k.py trained 6x longer on 2.7x larger
batches, with the dropout that this data's size wants.

  python -m transformer_jax.main --config configs/multi30k_gpu.py --workdir runs/multi30k_gpu \
      --config.data_dir=../shared/data/multi30k
  python -m transformer_jax.main --workdir runs/multi30k_gpu --mode evaluate

The same 3+3-layer post-LN Transformer (d 256, 7.6M parameters) on packed rows of 64 tokens:
6,000 steps of 128 rows, dropout 0.3. Issue #18 reports, on one NVIDIA H100 80GB (jax 0.11.2):
test BLEU 40.18 (validation 42.99) in about 2 minutes, against 36.38 with dropout 0.1. Run from
this file with --config.model.dtype=bfloat16 --config.model.attention_implementation=auto
(cuDNN), issue #41 measured test BLEU 39.76 (validation 41.86) after 56 s of steps
(benchmarks/RESULTS.md, GPU section).
`:hub` reads bentrevett/multi30k from the Hugging Face Hub instead, as configs/multi30k.py:hub.
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' or 'hub' (the Hugging Face Hub's copy), as configs/multi30k.py."""
  config = default_config.sibling(__file__, "multi30k", data)
  # 6,000 steps x 128 packed rows of 64 tokens: about 85 epochs of the 29,000 pairs.
  config.num_train_steps = 6_000
  config.per_device_batch_size = 128
  # Log, evaluate (validation BLEU, beam 4) and checkpoint less often than on the CPU.
  config.log_every_steps = 200
  config.eval_every_steps = 2_000
  config.checkpoint_every_steps = 2_000
  # Residual, embedding and FFN dropout: 0.3 beat 0.1 by 3.8 test BLEU (issue #18).
  config.model.dropout_rate = 0.3
  return config
