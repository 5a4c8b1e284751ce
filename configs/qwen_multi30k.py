"""Qwen2.5-0.5B (the base model) fine-tuned on Multi30k en->de as a text continuation: the
prompt `English: SOURCE\nGerman:\n` in the raw format (the checkpoint's own tokenization, no
separator tokens), the German sentence after it, loss on the German only; sacreBLEU on
test_2016.

  python -m transformer_jax.main --config configs/qwen_multi30k.py --workdir runs/qwen_m30k \
      --config.data_dir=../shared/data/multi30k
  python -m transformer_jax.main --workdir runs/qwen_m30k --mode evaluate

Qwen/Qwen2.5-0.5B: 494M parameters, 24 layers, grouped-query attention (14 query heads, 2
key/value), q/k/v biases, a 151,936-token byte-level BPE. 1,500 steps of 32 pairs at 3e-5,
bfloat16 activations, beam 4. A GPU is advised.
Expected: not yet measured here; no published Qwen2.5-0.5B Multi30k figure is quoted. Compare
with configs/opus_mt_multi30k.py (a 74M translation model) on the same test set.
`:hub` reads the pairs from the Hugging Face Hub's bentrevett/multi30k.
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' (config.data_dir) or 'hub' (the Hugging Face Hub's bentrevett/multi30k)."""
  config = default_config.sibling(__file__, "multi30k", data)
  config.architecture = "decoder_only"
  config.pretrained = "Qwen/Qwen2.5-0.5B"
  config.prompt_format = "raw"
  config.prompt_template = "English: {source}\nGerman:\n"
  config.max_source_length = 80
  config.max_target_length = 64
  config.model.max_len = 144  # the checkpoint fixes it; this file alone must validate
  config.model.dtype = "bfloat16"
  config.model.dropout_rate = 0.0
  config.num_train_steps = 1_500
  config.per_device_batch_size = 32
  config.learning_rate = 3e-5
  config.warmup_steps = 100
  config.weight_decay = 0.0
  config.label_smoothing = 0.1
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.checkpoint_best_metric = "bleu"
  config.decoding.update(method="beam", beam_size=4, alpha=0.6, max_decode_len=64)
  return config
