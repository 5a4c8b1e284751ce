"""Hugging Face checkpoints in and out: the only package that knows Hugging Face names.

  checkpoint.py  folder / hub name -> config translation and parameters (safetensors)
  t5.py, bart.py, marian.py  one architecture each: config fields, special ids, weight table
  mapping.py     weight-name tables and their conversions, both directions
  vocab.py       the checkpoint's ids renumbered to this project's pad 0 / eos 1
  tokenizer.py   the checkpoint's own tokenizer behind this project's tokenizer interface
  generation.py  generation_config.json -> config.decoding settings
  run_config.py  a run's config around a checkpoint; the checkpoint files a workdir keeps
  export.py      a fine-tuned workdir -> a Hugging Face folder
"""
