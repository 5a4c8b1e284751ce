"""A small instruction-tuned LLM fine-tuned on DialogSum in its own chat format: the dialogue
in a user turn (after a system prompt), the summary as the assistant's reply, loss on the
reply and its end token only, ROUGE on the test split.

  python -m transformer_jax.main --config configs/llm_dialogsum.py --workdir runs/smollm2_dsum \
      --config.data_dir=../shared/data/dialogsum                     # SmolLM2-360M-Instruct
  python -m transformer_jax.main --config configs/llm_dialogsum.py:qwen2.5 \
      --workdir runs/qwen_dsum --config.data_dir=../shared/data/dialogsum
  python -m transformer_jax.main --config configs/llm_dialogsum.py:llama3.2,hub \
      --workdir runs/llama_dsum                          # the Hub's knkarthick/dialogsum
  python -m transformer_jax.main --workdir runs/smollm2_dsum --mode export --output hf_out

Models (the checkpoint fixes the architecture, tokenizer and chat template):
  smollm2   HuggingFaceTB/SmolLM2-360M-Instruct (362M, ChatML, <|im_end|> ends a reply)
  qwen2.5   Qwen/Qwen2.5-0.5B-Instruct (494M, ChatML)
  llama3.2  meta-llama/Llama-3.2-1B-Instruct (1.24B, <|eot_id|> ends a reply; gated on the Hub:
            log in, or pass a downloaded folder as --config.pretrained)
Dialogues up to 448 tokens, summaries up to 96; 1,200 steps of 16 examples at 5e-5 (1e-4
for SmolLM2), greedy decoding. bfloat16 activations; a GPU is advised (about 8 GB for the
0.5B model in full fine-tuning at this batch).
Expected: not yet measured here. Published instruction-tuned models of this size reach about
40-47 ROUGE-1 on DialogSum after fine-tuning; compare with configs/flan_t5_dialogsum.py.
"""

from transformer_jax import default_config

MODELS = {"smollm2": ("HuggingFaceTB/SmolLM2-360M-Instruct", 1e-4),
          "qwen2.5": ("Qwen/Qwen2.5-0.5B-Instruct", 5e-5),
          "llama3.2": ("meta-llama/Llama-3.2-1B-Instruct", 5e-5)}


def get_config(arg: str = ""):
  """`arg`: the model (smollm2, qwen2.5, llama3.2) and/or 'hub', comma-separated."""
  model, data = default_config.options(arg, model=tuple(MODELS), data=("local", "hub"))
  config = default_config.sibling(__file__, "dialogsum", data)
  config.architecture = "decoder_only"
  config.pretrained, config.learning_rate = MODELS[model]
  config.prompt_format = "chat"
  config.system_prompt = "You are a helpful assistant who writes concise summaries."
  config.prompt_template = "Summarize this dialogue in one or two sentences:\n{source}"
  config.max_source_length = 448  # the rendered prompt: template, system turn and dialogue
  config.max_target_length = 96
  # The checkpoint fixes max_len; this file alone must still hold the sequences to validate.
  config.model.max_len = 544
  config.model.dtype = "bfloat16"
  config.model.dropout_rate = 0.0
  config.num_train_steps = 1_200
  config.per_device_batch_size = 16
  config.warmup_steps = 60
  config.weight_decay = 0.0
  config.label_smoothing = 0.0
  config.eval_every_steps = 400
  config.checkpoint_every_steps = 400
  config.checkpoint_best_metric = "rougeL"
  config.decoding.update(method="greedy", max_decode_len=96)
  return config
