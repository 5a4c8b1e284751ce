"""Demo: English -> German on the embedded grammar (agreement, case, verb-second, verb-final).

  python -m transformer_jax.main --config configs/demo.py --workdir runs/demo

Generates the data on first use (a few seconds, cached), trains a SentencePiece tokenizer and a
small post-LN Transformer. On a 2-core CPU: about 8 minutes, test BLEU about 9x (see README).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # Where the text pairs come from: 'demo' = the embedded English -> German grammar.
  config.dataset = "demo"
  # Sizes and seed of the generated splits; cache_dir '' = ~/.cache/transformer_jax.
  config.demo = ml_collections.ConfigDict(
      dict(num_train=40_000, num_validation=1_000, num_test=1_000, seed=0, cache_dir=""))
  # SentencePiece: 'bpe' or 'unigram'; coverage 1.0 keeps every character of this data.
  config.tokenizer = ml_collections.ConfigDict(
      dict(model_type="bpe", character_coverage=1.0, byte_fallback=False))
  # Token lengths (EOS included); longer texts are truncated and counted in the log.
  config.max_source_length = 24
  config.max_target_length = 28

  # Total optimizer steps.
  config.num_train_steps = 1_000
  # Examples per device per step; the global batch is this times the device count.
  config.per_device_batch_size = 64
  # Micro-batches per optimizer step (gradient accumulation): the update of a batch this many
  # times larger, in the memory of one micro-batch.
  config.grad_accum_steps = 1
  # Peak learning rate, reached after warmup_steps, then decayed as 1/sqrt(step).
  config.learning_rate = 2e-3
  # Linear warmup steps.
  config.warmup_steps = 200
  # Label smoothing of the training loss (the paper's 0.1).
  config.label_smoothing = 0.1
  # AdamW weight decay; 0 = plain Adam as in the paper.
  config.weight_decay = 0.0
  # Clip gradients to this global norm; 0 = no clipping.
  config.grad_clip_norm = 0.0
  # Seed for initialisation, data order and dropout.
  config.seed = 0

  # Train metrics are fetched from the devices (and logged) every this many steps.
  config.log_every_steps = 100
  # Evaluate loss / accuracy / BLEU on eval_split every this many steps, and at the end.
  config.eval_every_steps = 250
  # Split used for evaluation during training; --mode evaluate uses the test split.
  config.eval_split = "validation"
  # Output generation for BLEU, evaluate and predict.
  config.decoding = ml_collections.ConfigDict(dict(
      method="beam",  # 'greedy', 'beam' or 'sample'
      beam_size=4,  # beam search: slots per example
      alpha=0.6,  # beam search: GNMT length-penalty exponent
      temperature=1.0,  # sampling: 0 = greedy
      top_k=0,  # sampling: keep the k most likely tokens; 0 = all
      top_p=1.0,  # sampling: keep the smallest set holding this probability
      max_decode_len=0,  # longest output; 0 = source length + 50 (capped at model.max_len)
      seed=0,  # sampling seed
  ))
  # Examples translated for BLEU at each evaluation; -1 = the whole split.
  config.num_bleu_examples = 500
  # Save a checkpoint every this many steps, and at the end.
  config.checkpoint_every_steps = 250
  # Keep the newest this many checkpoints.
  config.keep_checkpoints = 3

  # Model hyper-parameters: fields of transformer_jax.models.TransformerConfig.
  config.model = ml_collections.ConfigDict(dict(
      vocab_size=512,  # also the tokenizer's size
      emb_dim=128,
      num_heads=4,
      num_layers=3,
      qkv_dim=128,
      mlp_dim=512,
      max_len=32,
      dropout_rate=0.1,
      attention_dropout_rate=0.0,
      dtype="float32",
      pre_ln=False,
      position_embedding="sinusoidal",
      attention_implementation="reference",  # or "xla", "cudnn", "auto" (jax.nn)
  ))
  return config
