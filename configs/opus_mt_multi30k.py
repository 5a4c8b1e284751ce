"""Helsinki-NLP/opus-mt-en-de (Marian) fine-tuned on Multi30k en->de, sacreBLEU on test_2016.

  python -m transformer_jax.main --config configs/opus_mt_multi30k.py \
      --workdir runs/opus_mt_multi30k --config.data_dir=../shared/data/multi30k
  python -m transformer_jax.main --workdir runs/opus_mt_multi30k --mode evaluate
  # The checkpoint before any fine-tuning, on the same test set:
  python -m transformer_jax.main --pretrained Helsinki-NLP/opus-mt-en-de --mode evaluate \
      --config configs/opus_mt_multi30k.py --config.data_dir=../shared/data/multi30k

The checkpoint (74M parameters, its source/target SentencePiece models and vocab.json) fixes
the model; its generation config bans the pad token and forces EOS at the length limit.
Expected (literature, not yet measured here): opus-mt-en-de scores 40.9 BLEU on newstest2019
before fine-tuning; Multi30k test BLEU in the low 40s after 1,500 steps (GPU advised).
`:hub` reads the same pairs from the Hugging Face Hub's bentrevett/multi30k, as
configs/multi30k.py:hub does:
  python -m transformer_jax.main --config configs/opus_mt_multi30k.py:hub \
      --workdir runs/opus_mt_multi30k_hub
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' (config.data_dir) or 'hub' (the Hugging Face Hub's bentrevett/multi30k)."""
  config = default_config.sibling(__file__, "multi30k", data)
  config.pretrained = "Helsinki-NLP/opus-mt-en-de"
  config.max_source_length = 64
  config.max_target_length = 64
  config.num_train_steps = 1_500
  config.per_device_batch_size = 32
  config.learning_rate = 5e-5
  config.warmup_steps = 100
  config.label_smoothing = 0.1
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.checkpoint_best_metric = "bleu"
  config.decoding.update(method="beam", beam_size=4, alpha=0.6, max_decode_len=64)
  return config
