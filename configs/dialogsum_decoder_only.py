"""DialogSum as a decoder-only prefix LM: `DIALOGUE <eos> SUMMARY <eos>`, loss on the summary.

  python -m transformer_jax.main --config configs/dialogsum_decoder_only.py \
      --workdir runs/dialogsum_lm --config.data_dir=../shared/data/dialogsum
  python -m transformer_jax.main --workdir runs/dialogsum_lm --mode evaluate

Inference fills the KV cache with `DIALOGUE <eos>` and generates the summary (greedy here).
Same data and sizes as configs/dialogsum.py, one 4-layer pre-LN decoder (d 256). The README's
results table has the time and ROUGE measured on its 2-core CPU.
"""

from transformer_jax import default_config


def get_config():
  config = default_config.get_config()
  config.task = "summarization"
  config.architecture = "decoder_only"
  config.dataset = "local"
  config.data_dir = ""  # --config.data_dir=../shared/data/dialogsum
  # The test split has three human summaries (summary1..3); the first is the reference.
  config.local.update(format="jsonl", source_field="dialogue", target_field="summary|summary1")
  config.splits.update(train="train", validation="dev", test="test")
  config.model.vocab_size = 8000
  config.max_source_length = 256
  config.max_target_length = 64
  config.num_train_steps = 1_200
  config.per_device_batch_size = 16
  config.learning_rate = 1e-3
  config.warmup_steps = 300
  config.log_every_steps = 50
  config.eval_every_steps = 1_200
  config.checkpoint_every_steps = 400
  config.num_generate_examples = 100
  config.decoding.update(method="greedy", max_decode_len=64)
  config.model.update(emb_dim=256, num_heads=4, num_layers=4, qkv_dim=256, mlp_dim=1024,
                      max_len=320, dropout_rate=0.1, pre_ln=True)
  return config
