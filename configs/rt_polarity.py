"""rt-polarity (Pang & Lee sentence polarity v1.0), accuracy and macro-F1.

  python -m transformer_jax.main --config configs/rt_polarity.py --workdir runs/rt_polarity \
      --config.data_dir=../shared/data/rt_polarity

The corpus is two files (negative, positive) without splits: a seeded 80/10/10 train /
validation / test split is made at load time (config.data_seed), the same in every run. 8,530
training sentences, a 2-layer encoder (d 128). Expect roughly 70-75% test accuracy from
scratch; the README's results table has what was measured.
"""

from transformer_jax import default_config


def get_config():
  config = default_config.get_config()
  config.task = "classification"
  config.dataset = "local"
  config.data_dir = ""  # --config.data_dir=../shared/data/rt_polarity
  config.local.update(format="label_files", encoding="latin-1",
                      label_files=["rt-polarity.neg", "rt-polarity.pos"])
  config.label_names = ["negative", "positive"]
  config.model.vocab_size = 8000
  config.max_source_length = 80
  config.label_smoothing = 0.0
  config.num_train_steps = 1_000
  config.per_device_batch_size = 64
  config.learning_rate = 5e-4
  config.warmup_steps = 100
  config.weight_decay = 0.01
  config.log_every_steps = 100
  config.eval_every_steps = 250
  config.checkpoint_every_steps = 250
  config.model.update(emb_dim=128, num_heads=4, num_layers=2, qkv_dim=128, mlp_dim=512,
                      max_len=80, dropout_rate=0.2, num_classes=2, pooling="mean")
  return config
