"""UIT-VSFC: Vietnamese student feedback sentiment (negative / neutral / positive), accuracy
and macro-F1 on dev and test.

  python -m transformer_jax.main --config configs/uit_vsfc.py --workdir runs/uit_vsfc \
      --config.data_dir=../shared/data/uit_vsfc

11,426 training sentences (train/, dev/, test/ folders of line-aligned sents.txt and
sentiments.txt), a 4,000-piece BPE with full character coverage for Vietnamese diacritics, a
2-layer encoder (d 128). Neural baselines reach 88-92% accuracy; the README's results table has
what was measured on its 2-core CPU.

`:hub` reads the same corpus from the Hugging Face Hub (uitnlp/vietnamese_students_feedback:
sentence -> sentiment, train / validation / test = the folder's train / dev / test), cached by
the datasets library on the first run:
  python -m transformer_jax.main --config configs/uit_vsfc.py:hub --workdir runs/uit_vsfc_hub
The repository's main branch holds a loading script, which the datasets library no longer
runs, so the Hub's Parquet conversion of it (revision refs/convert/parquet) is read. Expect the
local run's dev / test accuracy, 91.2% / 89.5% (benchmarks/RESULTS.md; not yet measured on the
Hub copy).
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' (config.data_dir) or 'hub' (the Hugging Face Hub's
  uitnlp/vietnamese_students_feedback)."""
  (data,) = default_config.options(data, data=("local", "hub"))
  config = default_config.get_config()
  config.task = "classification"
  config.dataset = "local"
  config.data_dir = ""  # --config.data_dir=../shared/data/uit_vsfc
  config.local.update(format="label_lines", text_file="sents.txt", label_file="sentiments.txt")
  config.splits.update(train="train", validation="dev", test="test")
  config.label_names = ["negative", "neutral", "positive"]
  if data == "hub":
    config.dataset = "huggingface"
    # Parquet, not the loading script on main (datasets >= 4 runs no scripts).
    config.huggingface.update(name="uitnlp/vietnamese_students_feedback",
                              revision="refs/convert/parquet")
    # The topic column is the corpus's other task.
    config.huggingface.columns.update(source="sentence", label="sentiment")
    config.splits.update(train="train", validation="validation", test="test")
  config.tokenizer.update(character_coverage=1.0, byte_fallback=True)
  config.model.vocab_size = 4000
  config.max_source_length = 64
  config.label_smoothing = 0.0
  config.num_train_steps = 1_500
  config.per_device_batch_size = 64
  config.learning_rate = 1e-3
  config.warmup_steps = 150
  config.weight_decay = 0.01
  config.log_every_steps = 100
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.model.update(emb_dim=128, num_heads=4, num_layers=2, qkv_dim=128, mlp_dim=512,
                      max_len=64, dropout_rate=0.1, num_classes=3, pooling="mean")
  return config
