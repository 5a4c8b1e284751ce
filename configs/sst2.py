"""SST-2 sentence sentiment (GLUE TSV files), accuracy and macro-F1 on dev and test.

  python -m transformer_jax.main --config configs/sst2.py --workdir runs/sst2 \
      --config.data_dir=../shared/data/sst2
  python -m transformer_jax.main --workdir runs/sst2 --mode evaluate   # the labelled test split

67,349 training phrases, an 8,000-piece BPE, a 2-layer encoder (d 128) with mean pooling. The
README's results table has the time and dev / test accuracy measured on its 2-core CPU.
"""

from transformer_jax import default_config


def get_config():
  config = default_config.get_config()
  config.task = "classification"
  config.dataset = "local"
  config.data_dir = ""  # --config.data_dir=../shared/data/sst2
  # The dev and test files name the text column "content".
  config.local.update(format="tsv", text_column="sentence|content", label_column="label")
  config.splits.update(train="train", validation="dev", test="test")
  config.label_names = ["negative", "positive"]
  config.model.vocab_size = 8000
  config.max_source_length = 64
  config.label_smoothing = 0.0
  config.num_train_steps = 2_000
  config.per_device_batch_size = 64
  config.learning_rate = 1e-3
  config.warmup_steps = 200
  config.weight_decay = 0.01
  config.log_every_steps = 100
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.model.update(emb_dim=128, num_heads=4, num_layers=2, qkv_dim=128, mlp_dim=512,
                      max_len=64, dropout_rate=0.1, num_classes=2, pooling="mean")
  return config
