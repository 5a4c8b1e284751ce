"""Hugging Face checkpoints in and out: the only package that knows Hugging Face names.

  checkpoint.py  folder / hub name -> config translation and parameters (safetensors)
  gguf_file.py   a GGUF file (llama.cpp's) read as a checkpoint: metadata -> config.json and
                 tokenizer, Q8_0 / Q4_0 kernels kept quantized, other types dequantized
  files.py       a folder's files as untrusted input: safetensors headers and shard indexes
                 checked against the files, JSON files, nothing unpickled or imported
  chat_template.py  a tokenizer's chat template, checked and rendered in jinja2's sandbox
  architecture.py  what an architecture module offers, and the registry of them (MODEL_TYPES)
  t5.py, bart.py, marian.py, m2m_100.py  encoder-decoders: config fields, special ids,
                 weight table
  languages.py   multilingual checkpoints' language codes (NLLB, M2M100, mBART-50, cc25)
  bert.py        BERT / RoBERTa / XLM-R classifiers (the same, plus the classification head)
  gpt2.py        GPT-2 as the decoder-only family
  llama.py       Llama 2 / 3, SmolLM2, Mistral, Qwen2 / 2.5 / 3 as the decoder-only family
  gemma.py       Gemma 1 / 2 / 3 as the decoder-only family
  mapping.py     weight-name tables and their conversions, both directions; HF activations
  vocab.py       the checkpoint's ids renumbered to this project's pad 0 / eos 1 (a pad added
                 where the checkpoint has none: GPT-2)
  tokenizer.py   the checkpoint's own tokenizer behind this project's tokenizer interface
  generation.py  generation_config.json -> config.decoding settings
  run_files.py   the files a workdir keeps for its run: its tokenizer, a checkpoint's configs
                 (a run's config around a checkpoint is ../pretrained_run.py, above this package)
  export.py      a fine-tuned workdir -> a Hugging Face folder
  peft.py        LoRA adapters in and out in PEFT's format (adapter_config.json + safetensors)
"""
