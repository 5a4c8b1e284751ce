"""Multi30k English -> German (task 1), BLEU on test_2016_flickr, from the shared raw files.

  python -m transformer_jax.main --config configs/multi30k.py --workdir runs/multi30k \
      --config.data_dir=../shared/data/multi30k
  python -m transformer_jax.main --workdir runs/multi30k --mode evaluate

29,000 training pairs, a joint 8,000-piece BPE, a 3+3-layer post-LN Transformer (d 256, 4
heads, ff 1024; 7.6M parameters) on packed rows of 64 tokens, 1,000 steps. On the README's
2-core CPU: about 40 minutes of the whole machine; validation BLEU 36.2 at step 1,000 (beam
4); the test BLEU is in the README's results table.

`:hub` reads the same pairs from the Hugging Face Hub (bentrevett/multi30k: train 29,000,
validation 1,014, test = test_2016_flickr 1,000), cached by the datasets library on the first
run, so expect the local run's validation / test BLEU, 36.2 / 33.63 (benchmarks/RESULTS.md;
not yet measured on the Hub copy):
  python -m transformer_jax.main --config configs/multi30k.py:hub --workdir runs/multi30k_hub
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' (config.data_dir) or 'hub' (the Hugging Face Hub's bentrevett/multi30k)."""
  (data,) = default_config.options(data, data=("local", "hub"))
  config = default_config.get_config()
  config.task = "translation"
  config.dataset = "local"
  config.data_dir = ""  # --config.data_dir=../shared/data/multi30k
  config.local.update(format="parallel", source_lang="en", target_lang="de")
  config.splits.update(train="train", validation="val", test="test_2016_flickr")
  if data == "hub":
    config.dataset = "huggingface"
    config.huggingface.name = "bentrevett/multi30k"
    config.huggingface.columns.update(source="en", target="de")  # flat columns, one per language
    config.splits.update(train="train", validation="validation", test="test")
  config.model.vocab_size = 8000
  config.max_source_length = 64
  config.max_target_length = 64
  config.pack_examples = True
  config.num_train_steps = 1_000
  config.per_device_batch_size = 48
  config.learning_rate = 1e-3
  config.warmup_steps = 400
  config.log_every_steps = 50
  config.eval_every_steps = 1_000
  config.checkpoint_every_steps = 250
  config.keep_checkpoints = 5
  config.num_generate_examples = 500
  config.model.update(emb_dim=256, num_heads=4, num_layers=3, qkv_dim=256, mlp_dim=1024,
                      max_len=128, dropout_rate=0.1, share_embeddings=True)
  return config
