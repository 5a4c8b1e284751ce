"""BERT, RoBERTa and XLM-RoBERTa encoders (Hugging Face `model_type` bert, roberta,
xlm-roberta; PhoBERT and other RoBERTa-architecture checkpoints too), as classifiers.

Post-LN blocks with biases, learned positions, token-type embeddings, a LayerNorm over the
embeddings, erf GELU. BERT pools with a tanh dense layer over [CLS] (`pooler`) before its
`classifier`; RoBERTa's head is a dropout, a tanh dense layer over <s> (`classifier.dense`),
a dropout and `classifier.out_proj`. RoBERTa numbers positions from padding_idx + 1 (rows
before are never read), so its table is read from there. Ids: BERT pad 0, [SEP] ends a
sequence; RoBERTa <s> 0, pad 1, </s> 2.

A checkpoint is a bare encoder (BertModel, RobertaForMaskedLM: a fresh head is made) or a
sequence classifier (its head and `id2label` are kept); other tensors (a masked-LM head) are
left out. Export writes a ...ForSequenceClassification folder.
"""

from __future__ import annotations

from typing import Collection

from transformer_jax.pretrained.mapping import (Entry, Layer, activation, attention_entries,
                                               config_value, dense_entries, norm_entries)

MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
FAMILY = "encoder_classifier"
EMBEDDING_TENSOR, OUTPUT_TENSOR = "embeddings.word_embeddings.weight", None  # no LM output
_ATTENTION = dict(q="self.query", k="self.key", v="self.value", o="output.dense")
_PREFIXES = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta."}
ARCHITECTURES = {"bert": "BertForSequenceClassification",
                 "roberta": "RobertaForSequenceClassification",
                 "xlm-roberta": "XLMRobertaForSequenceClassification"}


def export_config(hf: dict, label_names) -> dict:
  """config.json of the sequence classifier an export writes, with the run's labels."""
  return dict(hf, architectures=[ARCHITECTURES[hf["model_type"]]],
              id2label={str(i): name for i, name in enumerate(label_names)},
              label2id={name: i for i, name in enumerate(label_names)})


def _is_roberta(hf: dict) -> bool:
  return hf["model_type"] != "bert"


def position_offset(hf: dict) -> int:
  """Rows before the first position: RoBERTa's padding_idx + 1, BERT's 0."""
  return config_value(hf, "pad_token_id", 1) + 1 if _is_roberta(hf) else 0


def model_fields(hf: dict, tied: bool) -> dict:
  """TransformerConfig fields of the checkpoint's config.json (`tied`: unused, no output)."""
  del tied
  kind = config_value(hf, "position_embedding_type", "absolute")
  if kind != "absolute":
    raise ValueError(f"position_embedding_type={kind!r} is not supported (only 'absolute').")
  ffn_activation = activation(hf, "hidden_act", "gelu")
  dropout = config_value(hf, "hidden_dropout_prob", 0.1)
  return dict(
      vocab_size=hf["vocab_size"], emb_dim=hf["hidden_size"],
      num_heads=hf["num_attention_heads"], qkv_dim=hf["hidden_size"],
      mlp_dim=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
      max_len=hf["max_position_embeddings"] - position_offset(hf),
      dropout_rate=dropout,
      attention_dropout_rate=config_value(hf, "attention_probs_dropout_prob", 0.1),
      activation_dropout_rate=0.0, pre_ln=False, final_norm=False, norm="layernorm",
      layer_norm_epsilon=config_value(hf, "layer_norm_eps", 1e-12),
      ffn_activation=ffn_activation, use_bias=True, scale_attention_scores=True,
      position_embedding="learned", scale_embeddings=False, embedding_norm=True,
      num_token_types=config_value(hf, "type_vocab_size", 2),
      pooling="cls_head" if _is_roberta(hf) else "cls_pooler",
      bos_id=config_value(hf, "bos_token_id", special_ids(hf)[1]))


def special_ids(hf: dict) -> tuple[int, int]:
  """The checkpoint's (pad, end-of-sequence) ids (BERT: [SEP], see `complete_config`)."""
  if _is_roberta(hf):
    return config_value(hf, "pad_token_id", 1), config_value(hf, "eos_token_id", 2)
  return config_value(hf, "pad_token_id", 0), config_value(hf, "sep_token_id", 102)


def complete_config(hf: dict, folder: str) -> dict:
  """config.json with BERT's [SEP] id, which BERT configs leave to the tokenizer files (102
  in Google's vocabularies, not in every BERT's)."""
  if _is_roberta(hf) or "sep_token_id" in hf:
    return hf
  import transformers  # pylint: disable=g-import-not-at-top
  try:
    sep = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True).sep_token_id
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"its tokenizer files do not load ({type(e).__name__}); a BERT folder "
                     "needs them (vocab.txt or tokenizer.json)") from None
  if sep is None:
    raise ValueError("its tokenizer has no [SEP] token")
  return dict(hf, sep_token_id=sep)


def _prefix(hf: dict, names: Collection[str] | None) -> str:
  """What the encoder's tensor names start with: 'bert.' / 'roberta.' under a task head,
  '' in a bare BertModel / RobertaModel."""
  if names is None:
    return _PREFIXES[hf["model_type"]]
  for prefix in (_PREFIXES[hf["model_type"]], ""):
    if prefix + EMBEDDING_TENSOR in names:
      return prefix
  raise ValueError(f"no tensor {EMBEDDING_TENSOR} (under any prefix): not a "
                   f"{hf['model_type']} checkpoint")


def head_tensors(hf: dict) -> tuple[str, ...]:
  """The classification head's tensors (a sequence classifier's; a bare encoder has none)."""
  return ("classifier.out_proj.weight",) if _is_roberta(hf) else ("classifier.weight",)


def weight_table(hf: dict, fields: dict, names: Collection[str] | None = None) -> list[Entry]:
  """Every parameter of our EncoderClassifier that the checkpoint holds (`names`: its
  tensors; None = a sequence classifier's full set, as export writes)."""
  prefix = _prefix(hf, names)
  has = lambda name: names is None or name in names
  embeddings = f"{prefix}embeddings"
  table = [Entry(("embedding", "embedding", "embedding"),
                 (f"{embeddings}.word_embeddings.weight",), "vocab_rows"),
           Entry(("positions", "pos_embedding"), (f"{embeddings}.position_embeddings.weight",),
                 "offset_rows", position_offset(hf))]
  if fields["num_token_types"]:
    table.append(Entry(("token_types",), (f"{embeddings}.token_type_embeddings.weight",)))
  table += norm_entries(("embedding_norm",), f"{embeddings}.LayerNorm", bias=True)
  for i in range(fields["num_layers"]):
    layer, hf_layer = Layer("encoder", i), f"{prefix}encoder.layer.{i}"
    table += attention_entries(layer.attention(), f"{hf_layer}.attention", _ATTENTION,
                               self_attention=True, bias=True)
    table += norm_entries(layer.attention_norm(), f"{hf_layer}.attention.output.LayerNorm",
                          bias=True)
    table += dense_entries(layer.ffn("wi"), f"{hf_layer}.intermediate.dense", bias=True)
    table += dense_entries(layer.ffn("wo"), f"{hf_layer}.output.dense", bias=True)
    table += norm_entries(layer.ffn_norm(), f"{hf_layer}.output.LayerNorm", bias=True)
  if _is_roberta(hf):
    # A bare RoBERTa's own pooler is not RoBERTa's head (transformers drops it too).
    pooler, head = "classifier.dense", "classifier.out_proj"
  else:
    pooler, head = f"{prefix}pooler.dense", "classifier"
  if has(f"{pooler}.weight"):
    table += dense_entries(("pooler",), pooler, bias=True)
  if has(f"{head}.weight"):
    table += dense_entries(("head",), head, bias=True)
  return table
