"""Every config key with its default and what it means; experiment configs override a few.

  from transformer_jax import default_config
  def get_config():
    config = default_config.get_config()
    config.task = "classification"
    ...
"""

import importlib.util
import os

import ml_collections

from transformer_jax import parallel
from transformer_jax.model import schema as model_schema


def load(path: str, *args: str) -> ml_collections.ConfigDict:
  """`get_config(*args)` of the config file at `path`, e.g. a sibling config to build a variant
  on; `args` is what follows ':' on the command line (`configs/sst2.py:hub` -> 'hub')."""
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(f"transformer_jax_config_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*args)


def sibling(config_file: str, name: str, *args: str) -> ml_collections.ConfigDict:
  """The config `name`.py in the folder of `config_file` (pass a config's `__file__`), built
  with `args` (a variant such as 'hub', passed on by a config that builds on it)."""
  return load(os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py"), *args)


def options(arg: str, **choices: tuple[str, ...]) -> tuple[str, ...]:
  """A config's variant argument split into one value per option, each defaulting to the first
  of its choices.

  ml_collections passes what follows ':' in `--config FILE:TEXT` as one string, so a config
  with several options takes them comma-separated, in any order:
  `options('hub,roberta', model=('bert', 'roberta'), data=('local', 'hub'))` is
  ('roberta', 'hub'), and `options('', ...)` is ('bert', 'local').

  Raises:
    ValueError: a part that is no option's choice, or two parts for one option.
  """
  picked = {}
  for part in filter(None, (p.strip() for p in arg.split(","))):
    names = [name for name, values in choices.items() if part in values]
    if not names:
      known = "; ".join(f"{name}: {', '.join(values)}" for name, values in choices.items())
      raise ValueError(f"Unknown config variant {part!r} in {arg!r}; give at most one of each "
                       f"option, comma-separated ({known}).")
    if names[0] in picked:
      raise ValueError(f"Config variant {arg!r} gives the {names[0]} twice "
                       f"({picked[names[0]]!r} and {part!r}).")
    picked[names[0]] = part
  return tuple(picked.get(name, values[0]) for name, values in choices.items())


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # ---- Task and data ----------------------------------------------------------------------
  # 'translation' (BLEU), 'summarization' (ROUGE), 'classification' (accuracy, macro-F1) or
  # 'multitask' (T5-style text-to-text mixture, each part scored by its own metric).
  config.task = "translation"
  # Sequence-to-sequence model family: 'encoder_decoder', or 'decoder_only' (one causal LM over
  # `SOURCE <eos> TARGET <eos>`, loss on the target only). Classification always uses the
  # encoder with a pooling head.
  config.architecture = "encoder_decoder"
  # How a decoder-only model reads its source (data/prompt_format.py): 'task' (the format
  # above), 'raw' (text to continue, tokenized as a pretrained checkpoint's tokenizer does it:
  # what transformers' generate reads; serving a pretrained decoder-only checkpoint defaults to
  # it) or 'chat' (the source as a user message, rendered by the checkpoint's chat template;
  # the target is the assistant's reply).
  config.prompt_format = "task"
  # 'raw' and 'chat': the text (chat: the user's message), with {source} replaced by the
  # source text, e.g. 'Summarize this dialogue:\n{source}'.
  config.prompt_template = "{source}"
  # 'chat': a system message before it ('' = none).
  config.system_prompt = ""
  # Where examples come from: 'demo' (generated grammar), 'local' (config.data_dir), 'tfds' or
  # 'huggingface' (config.huggingface).
  config.dataset = "demo"
  # 'local': the dataset's folder, laid out as config.local.format describes.
  config.data_dir = ""
  # 'local': the files' format and fields (see transformer_jax/data/readers.py).
  config.local = ml_collections.ConfigDict(dict(
      format="parallel",  # parallel | jsonl | tsv | label_lines | label_files
      source_lang="en", target_lang="de",  # parallel: file suffixes
      source_field="source", target_field="target",  # jsonl: field names
      messages_field="",  # jsonl: a chat conversation's field instead ('messages'; chat format)
      text_column="sentence", label_column="label",  # tsv: header names
      text_file="sents.txt", label_file="sentiments.txt",  # label_lines: file names per split
      label_files=[],  # label_files: one file per class, class i = files[i]
      encoding="utf-8",  # text encoding of the files (rt-polarity is latin-1)
  ))
  # 'tfds': dataset name and feature keys; `tfds_data_dir` (or $TFDS_DATA_DIR, e.g. a GCS
  # bucket) holds the prepared data.
  # eval_name: another dataset for validation / test (flax trains on wmt17, tests on wmt14).
  config.tfds = ml_collections.ConfigDict(dict(
      name="", eval_name="", source_key="", target_key="", label_key="label"))
  config.tfds_data_dir = ""
  # 'huggingface' (the `datasets` library: pip install 'transformer_jax[hf]'): name is a Hub id
  # ('knkarthick/dialogsum', with subset and revision, e.g. 'wmt/wmt14' subset 'de-en'), a
  # local or gs:// folder written by save_to_disk, a folder of Parquet / JSON lines / CSV files
  # named by split, or a builder ('parquet', 'json', 'csv', 'arrow', 'text') reading
  # data_files per split (paths or globs, comma-separated). streaming: read the Hub's files
  # as a stream instead of preparing a local Arrow copy (for corpora too large for the disk).
  # columns: the source / target / label fields, 'translation.en' for one inside a dict
  # column; '' = the usual names (dialogue / summary, sentence / label, ...). A ClassLabel
  # label column gives config.label_names; messages: a column of chat conversations (lists
  # of {role, content} turns) instead of source / target, for prompt_format 'chat'. See
  # transformer_jax/data/hf_source.py.
  config.huggingface = ml_collections.ConfigDict(dict(
      name="", subset="", revision="", streaming=False,
      data_files=ml_collections.ConfigDict(dict(train="", validation="", test="")),
      columns=ml_collections.ConfigDict(dict(source="", target="", label="", messages=""))))
  # Our split -> the file stem (local) or split name (tfds, huggingface) that holds it.
  config.splits = ml_collections.ConfigDict(dict(
      train="train", validation="validation", test="test"))
  # 'demo': sizes and seed of the generated splits; cache_dir '' = ~/.cache/transformer_jax.
  config.demo = ml_collections.ConfigDict(
      dict(num_train=40_000, num_validation=1_000, num_test=1_000, seed=0, cache_dir=""))
  # classification: class names, written by predict and used in the multitask text form.
  config.label_names = ["negative", "positive"]
  # multitask: the mixed parts by name, each a dict of: prefix (the text put before every
  # source), task, data_dir (relative to config.data_dir), local, splits and label_names (as
  # above), max_train_examples and max_eval_examples (-1 = all). See configs/multitask.py.
  config.mixture = ml_collections.ConfigDict()

  # Start from a pretrained Hugging Face checkpoint: a folder (config.json, model.safetensors,
  # tokenizer files) or a hub name such as 'google/flan-t5-small' (the model_types of
  # pretrained/architecture.py: T5, BART, Marian, BERT, RoBERTa, GPT-2, Llama, Qwen2...). It
  # fixes config.model's architecture keys and the tokenizer (kept in WORKDIR/pretrained/);
  # dropout, dtype, lengths and everything else stay this config's. '' = train from random
  # weights.
  config.pretrained = ""
  # A classifier checkpoint's head is kept when it has config.model.num_classes classes; True
  # trains a new one (from the seed) for this config's classes instead.
  config.reset_head = False
  # LoRA (Hu et al., 2021) on a config.pretrained start: only low-rank adapters train (and a
  # classifier's head, in full); each step's checkpoint holds them alone, the frozen base is
  # kept once in WORKDIR/lora_base. Evaluate and predict merge them into the weights at load.
  config.lora = ml_collections.ConfigDict(dict(
      # Adapter rank r; 0 = off (full fine-tuning).
      rank=0,
      # Update scale alpha / r (alpha / sqrt(r) with rslora); None = r (scale 1).
      alpha=ml_collections.config_dict.placeholder(float),
      # Dropout on the adapters' input (PEFT's lora_dropout).
      dropout=0.0,
      # Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski, 2023).
      rslora=False,
      # Adapted projections of every attention and feed-forward layer, 'all' or some of:
      # query, key, value, attention_out, ffn_in (up and gate), ffn_out (down). Hugging Face
      # names: q/k/v/o (T5), q_proj/k_proj/v_proj/o_proj or out_proj, gate_proj + up_proj /
      # fc1 / wi, down_proj / fc2 / wo; BERT's query/key/value/attention.output.dense/
      # intermediate.dense/output.dense; GPT-2's c_attn/c_proj/c_fc/mlp.c_proj.
      targets="query,value",
      # The frozen base's dtype in memory and in WORKDIR/lora_base: 'float32', 'bfloat16'
      # (half the memory; computation stays in config.model.dtype), or 'int8' / 'int4'
      # (QLoRA: its kernels quantized as config.quantization describes, the adapters trained
      # in float over them; docs/quantization.md).
      base_dtype="float32",
      # Start the adapters from a PEFT adapter folder (adapter_config.json and
      # adapter_model.safetensors made for config.pretrained) instead of B = 0; '' = fresh.
      init="",
  ))
  # Weight-only quantization for --mode predict / evaluate / serve and Predictor, applied at
  # load (docs/quantization.md): 'none', 'int8' or 'int4'. Training refuses it (LoRA over a
  # quantized base: lora.base_dtype).
  config.quantization = ml_collections.ConfigDict(dict(
      weights="none",
      # Inputs per scale; 0 = one scale per output channel for int8, groups of 128 for int4.
      group_size=0,
      # Also the token embedding (int8, a scale per row; the tied output layer reads it) and
      # an untied output layer (as `weights`).
      embeddings=False,
  ))
  # A multilingual checkpoint's languages, in its own codes: NLLB-200 'vie_Latn', M2M100 'vi',
  # mBART-50 'vi_VN'. The source is tagged as the checkpoint expects and decoding forces the
  # target code as the first output token (pretrained/languages.py). '' = none (a checkpoint
  # with language codes needs target_lang; source_lang defaults to its tokenizer's).
  config.source_lang = ""
  config.target_lang = ""
  # Many translation directions in one run (data/directions.py): data-language pairs, e.g.
  # 'en-vi,vi-en' (local files train.en / train.vi, or a Hub `translation` dict's keys), and
  # their codes in the checkpoint, e.g. 'en=eng_Latn,vi=vie_Latn' (unnamed: the data name, as
  # M2M100's 'en'). Each example forces its own target code; evaluation scores each direction
  # and their mean. '' = the one direction of the data config.
  config.directions = ""
  config.language_codes = ""
  # Set by the import, not by hand: the checkpoint's tokenizer ends sentences itself with a
  # language code after EOS, `X </s> [code]` (mBART-cc25, NLLB's legacy_behaviour).
  config.code_after_eos = False
  # SentencePiece: trained on a sample of the training split and saved in the workdir, or an
  # existing .model file given by `path` (copied into the workdir).
  config.tokenizer = ml_collections.ConfigDict(dict(
      path="", model_type="bpe", character_coverage=1.0, byte_fallback=False,
      num_sentences=1_000_000))
  # Token lengths (EOS included). Longer texts are truncated ('truncate') or dropped from
  # training ('drop'); the counts are logged.
  config.max_source_length = 24
  config.max_target_length = 28
  config.overlong = "truncate"
  # Pack several short examples into each training row (segment ids and positions keep them
  # apart), so padding is not paid for. Evaluation and predict never pack.
  config.pack_examples = False

  # ---- Optimisation -----------------------------------------------------------------------
  # Total optimizer steps.
  config.num_train_steps = 1_000
  # Examples (rows, when packing) per device per step; global batch = this x device count.
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
  # Output layer and loss over this many target positions of every row at a time, each
  # chunk's logits recomputed in the backward pass: the float32 [rows, length, vocab] logits
  # (1.6 GB for 8 x 1024 tokens of a 50k vocabulary) never exist at once. 0 = all at once.
  config.logits_chunk_length = 0
  # With logits_chunk_length: each chunk's gradients taken in the forward pass (the output
  # layer fused with the loss, output_loss.py), no logits recomputed in the backward pass.
  config.fused_loss = False
  # AdamW weight decay; 0 = plain Adam as in the paper.
  config.weight_decay = 0.0
  # Clip gradients to this global norm; 0 = no clipping.
  config.grad_clip_norm = 0.0
  # Layer-wise learning-rate decay for fine-tuning (BERT / ELECTRA): the output layers learn
  # at the full rate, each layer below at this times the rate above it, the embeddings
  # lowest (see transformer_jax/layer_decay.py); 1.0 = off, e.g. 0.8 to fine-tune.
  config.layer_decay = 1.0
  # Seed for initialisation, data order and dropout.
  config.seed = 0
  # Seed for the data itself: held-out splits drawn at load time (config.local.format
  # 'label_files') and the capped samples of a mixture's parts. Apart from config.seed, so
  # that a new training seed never changes the test set.
  config.data_seed = 0
  # The training split is read as this many shards (example i in shard i % data_shards), each
  # with its own shuffled epochs; a global batch takes equal rows from every shard, and each
  # host of a pod reads and encodes only the shards its part of the batch comes from. 0 = one
  # per process. The order depends on this number alone: fix it (to a divisor of the global
  # batch) to resume a run on a different number of hosts.
  config.data_shards = 0
  # JAX's random-number generator for initialisation and dropout: 'threefry2x32' (JAX's
  # default: the same numbers on every backend and sharding), or 'rbg' / 'unsafe_rbg' (XLA's
  # bit generator, which MaxText uses on GPU and TPU for cheaper dropout masks; other numbers
  # per backend; no faster on CPU). Measurements: benchmarks/RESULTS.md.
  config.prng_impl = "threefry2x32"

  # ---- Devices ----------------------------------------------------------------------------
  # How the devices share the work (see transformer_jax/parallel.py). mode 'pmap': data
  # parallel over every local device, state replicated. mode 'jit': one program over a
  # (data, fsdp, tensor) mesh of all devices: batch split over data x fsdp, parameters and
  # optimizer state split over fsdp (embedding dim) and tensor (heads, MLP, vocabulary); the
  # sizes multiply to the device count, -1 = the rest. logical_axis_rules (jit): which mesh
  # axes each logical axis name of the parameters and activations is split over (the names
  # are given where the parameters are created: blocks.py, models.py, attention.py, layers.py).
  config.parallel = ml_collections.ConfigDict(dict(
      mode="pmap", data=-1, fsdp=1, tensor=1,
      logical_axis_rules=[list(rule) for rule in parallel.LOGICAL_RULES]))

  # ---- Logging, evaluation, checkpoints ---------------------------------------------------
  # Training batches built and placed on the devices this many steps ahead, in a background
  # thread (0 = built when needed).
  config.prefetch_batches = 2
  # Train metrics are fetched from the devices (and logged) every this many steps.
  config.log_every_steps = 100
  # Evaluate on eval_split every this many steps, and at the end.
  config.eval_every_steps = 250
  # Split used for evaluation during training; --mode evaluate uses the test split.
  config.eval_split = "validation"
  # Examples generated (BLEU / ROUGE) at each evaluation; -1 = the whole split.
  config.num_generate_examples = 500
  # Attention heatmaps written to TensorBoard at each evaluation, for the first generated
  # example (and drawn by --mode attention): these layers and heads of every attention kind
  # (negative: from the end). layers=() = none. Needs matplotlib.
  config.attention_images = ml_collections.ConfigDict(dict(layers=(-1,), heads=(0,)))
  # Output generation for BLEU / ROUGE, evaluate and predict.
  config.decoding = ml_collections.ConfigDict(dict(
      # 'greedy', 'beam' or 'sample'.
      method="beam",
      # Beam search: hypotheses kept per example.
      beam_size=4,
      # Beam search: length-penalty exponent (0 = plain log-probability).
      alpha=0.6,
      # Beam search: scores are log-probability / penalty, 'gnmt': ((5 + length) / 6) ** alpha,
      # or 'hf': length ** alpha (Hugging Face's length_penalty = alpha); length in output
      # tokens, EOS included.
      length_penalty="gnmt",
      # Sampling: softmax temperature, >= 0; 0 = greedy.
      temperature=1.0,
      # Sampling: keep the k most likely tokens; 0 = all.
      top_k=0,
      # Sampling: keep the smallest set holding this probability, in (0, 1].
      top_p=1.0,
      # Sampling: samples drawn per input; the most likely come first (best-of-n).
      num_decodes=1,
      # Longest output in tokens, EOS included; 0 = source length + 50 (capped at
      # model.max_len).
      max_decode_len=0,
      # A decoder-only model's prompt and output together, per row, where max_decode_len is 0
      # (Hugging Face's max_length, set from a checkpoint's generation_config.json): each
      # output ends after what its own prompt leaves; 0 = off.
      max_total_len=0,
      # Every method: the KV cache's keys and values kept in this dtype: '' = the model's,
      # 'float32', 'bfloat16' or 'int8' (a quarter of float32's memory; docs/quantization.md).
      kv_cache_dtype="",
      # Every method: no EOS before this many output tokens; 0 = off.
      min_length=0,
      # Every method: token ids never generated, e.g. (3, 7); () = none. Ids are the model's
      # own: for an imported checkpoint, renumbered (its pad is 0, its EOS 1; its
      # generation_config.json's bad_words_ids are added here).
      banned_ids=(),
      # Every method: CTRL repetition penalty on tokens already in the output (a decoder-only
      # model's prompt included, as transformers counts them), > 0; 1 = off, above 1
      # discourages repeats.
      repetition_penalty=1.0,
      # Every method: no n-gram of this many tokens twice in an output (Hugging Face's
      # no_repeat_ngram_size; the decoder start token is not part of the output); 0 = off.
      no_repeat_ngram_size=0,
      # Every method: the first output token is this id (Hugging Face's forced_bos_token_id,
      # set from an imported checkpoint's generation_config.json in the model's renumbered
      # ids); -1 = none.
      forced_bos_id=-1,
      # Every method: an output that reaches max_decode_len ends with EOS at its last position
      # (Hugging Face's forced_eos_token_id).
      forced_eos=False,
      # Every method: further ids that end an output as EOS does (an imported checkpoint's
      # other end tokens, from its generation_config.json's eos_token_id list: Llama 3's
      # <|eot_id|>, Qwen's <|im_end|>), in the model's renumbered ids.
      end_ids=(),
      # Sampling seed.
      seed=0,
  ))
  # --mode serve (docs/serving.md): concurrent requests decode together in batches of up to
  # max_batch_size rows (a power of two; each prompt x n choices is a row), started once
  # that many wait or max_wait_ms after the first; past max_queue waiting rows a request is
  # refused with HTTP 429; n (choices per prompt) is at most max_n. A batch decodes
  # stream_steps tokens per compiled call, and streamed requests get their new text after each
  # (fewer: sooner text, more host round trips). continuous_batching: rows finish and waiting
  # ones take their slots between those calls (False: each batch decodes to its end).
  # log_requests: a log line per request (uvicorn's access line and the rows it queued);
  # otherwise a line every log_stats_s seconds (0: none) while rows are answered.
  config.serve = ml_collections.ConfigDict(dict(
      max_batch_size=32, max_wait_ms=5.0, max_queue=1024, max_n=8, stream_steps=4,
      continuous_batching=True, log_requests=False, log_stats_s=10.0))
  # Save a checkpoint every this many steps, and at the end.
  config.checkpoint_every_steps = 250
  # Keep the newest this many checkpoints.
  config.keep_checkpoints = 3
  # Also keep the parameters of the best evaluation by this eval metric (e.g. 'bleu', 'chrf',
  # 'chrf++', 'rouge1', 'accuracy', 'loss') in WORKDIR/checkpoints_best, apart from the rotation
  # above (evaluate / predict with --checkpoint best); '' = off.
  config.checkpoint_best_metric = ""
  # 'max' (higher is better: bleu, chrf, rouge*, accuracy) or 'min' (loss, perplexity).
  config.checkpoint_best_mode = "max"
  # Stop training after this many evaluations in a row without a new best
  # checkpoint_best_metric (saving a final checkpoint); 0 = never stop early.
  config.early_stopping_evals = 0
  # Trace these training steps with jax.profiler into WORKDIR/profile (view it in
  # TensorBoard's Profile tab or Perfetto): (first step, number of steps); () = off.
  config.profile_steps = ()

  # ---- Model ------------------------------------------------------------------------------
  # Every field of transformer_jax.model.schema.TransformerConfig, with its default there (the one
  # source of model defaults; each field's meaning is commented in the dataclass). Sizes
  # (vocab_size, emb_dim, num_heads, num_layers, qkv_dim, mlp_dim, max_len) are set per
  # experiment; dtype is a name, e.g. 'bfloat16'.
  config.model = ml_collections.ConfigDict(model_schema.config_defaults())
  return config
