"""IMDB movie reviews sentiment (TFDS imdb_reviews), accuracy and macro-F1 on test.

  python -m transformer_jax.main --config configs/imdb_reviews.py --workdir runs/imdb \
      --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets
  python -m transformer_jax.main --workdir runs/imdb --mode evaluate

Prepare the data once on a machine with internet:
  tfds build imdb_reviews --data_dir=gs://BUCKET/tensorflow_datasets
25k training reviews cut to 512 tokens (no validation split in TFDS: the test split serves),
a 4-layer encoder (d 256), mean pooling. Expected 85-88% accuracy from scratch (literature).
Not yet measured by this project.

`:hub` reads the same reviews from the Hugging Face Hub (stanfordnlp/imdb, cached by the
datasets library on the first run):
  python -m transformer_jax.main --config configs/imdb_reviews.py:hub --workdir runs/imdb_hub
It has no validation split either; rather than watch the test split, it holds out 1,000
training reviews, the first and last 500 (the split is stored negatives first, so both ends
keep the classes balanced), and trains on the other 24,000. Expected as above (literature, not
measured here).
"""

from transformer_jax import default_config


def get_config(data: str = "tfds"):
  """`data`: 'tfds' (TFDS imdb_reviews) or 'hub' (the Hugging Face Hub's stanfordnlp/imdb)."""
  (data,) = default_config.options(data, data=("tfds", "hub"))
  config = default_config.get_config()
  config.task = "classification"
  config.dataset = "tfds"
  config.tfds.update(name="imdb_reviews", source_key="text", label_key="label")
  config.splits.update(train="train", validation="test", test="test")
  if data == "hub":
    config.dataset = "huggingface"
    config.huggingface.name = "stanfordnlp/imdb"
    config.huggingface.columns.update(source="text", label="label")
    # Validation from both ends of train: the split is ordered by class.
    config.splits.update(train="train[500:-500]", validation="train[:500]+train[-500:]",
                         test="test")
  config.label_names = ["negative", "positive"]
  config.model.vocab_size = 16_000
  config.max_source_length = 512
  config.label_smoothing = 0.0
  config.num_train_steps = 5_000
  config.per_device_batch_size = 32
  config.learning_rate = 5e-4
  config.warmup_steps = 500
  config.weight_decay = 0.01
  config.eval_every_steps = 1_000
  config.checkpoint_every_steps = 1_000
  config.model.update(emb_dim=256, num_heads=4, num_layers=4, qkv_dim=256, mlp_dim=1024,
                      max_len=512, dropout_rate=0.1, num_classes=2, pooling="mean")
  return config
