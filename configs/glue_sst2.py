"""SST-2 from TFDS (glue/sst2), accuracy and macro-F1 on the validation split (GLUE's test
labels are hidden, so `--mode evaluate` also uses validation here).

  python -m transformer_jax.main --config configs/glue_sst2.py --workdir runs/glue_sst2 \
      --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets

Prepare the data once on a machine with internet:
  tfds build glue/sst2 --data_dir=gs://BUCKET/tensorflow_datasets
Same model as configs/sst2.py (which reads the GLUE TSV files from a folder); that config's
measured accuracy is in the README.
"""

from transformer_jax import default_config


def get_config():
  config = default_config.get_config()
  config.task = "classification"
  config.dataset = "tfds"
  config.tfds.update(name="glue/sst2", source_key="sentence", label_key="label")
  config.splits.update(train="train", validation="validation", test="validation")
  config.label_names = ["negative", "positive"]
  config.model.vocab_size = 8000
  config.max_source_length = 64
  config.label_smoothing = 0.0
  config.num_train_steps = 2_000
  config.per_device_batch_size = 64
  config.learning_rate = 1e-3
  config.warmup_steps = 200
  config.weight_decay = 0.01
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.model.update(emb_dim=128, num_heads=4, num_layers=2, qkv_dim=128, mlp_dim=512,
                      max_len=64, dropout_rate=0.1, num_classes=2, pooling="mean")
  return config
