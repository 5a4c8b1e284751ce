"""Numerical parity with PyTorch's reference modules on identical weights (float32)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model import attention
from transformer_jax.model import blocks
from transformer_jax.model import models

torch = pytest.importorskip("torch")

E, HEADS, FF, VOCAB = 16, 4, 32, 50
BATCH, SRC, TGT = 2, 7, 6


def _config(pre_ln, activation="relu", layers=2, final_norm=None):
  return models.TransformerConfig(vocab_size=VOCAB, emb_dim=E, num_heads=HEADS, num_layers=layers,
                                  qkv_dim=E, mlp_dim=FF, max_len=32, dropout_rate=0.0,
                                  attention_dropout_rate=0.0, pre_ln=pre_ln,
                                  ffn_activation=activation, layer_norm_epsilon=1e-5,
                                  final_norm=final_norm)


def _t(x):
  return torch.tensor(np.asarray(x, np.float32))


def _load_attention(torch_mha, p):
  """Flax MultiHeadAttention params -> torch.nn.MultiheadAttention (fused in-projection)."""
  # Ours: self-attention has one fused 'qkv' projection [E, 3, h, d]; cross-attention has
  # 'query' [E, 1, h, d] and a fused 'kv' [E, 2, h, d]. Torch fuses q, k, v rows in that order.
  names = ["qkv"] if "qkv" in p else ["query", "kv"]
  w = [np.asarray(p[n]["kernel"]).reshape(E, -1).T for n in names]
  b = [np.asarray(p[n]["bias"]).reshape(-1) for n in names]
  torch_mha.in_proj_weight.data = _t(np.concatenate(w))
  torch_mha.in_proj_bias.data = _t(np.concatenate(b))
  torch_mha.out_proj.weight.data = _t(np.asarray(p["out"]["kernel"]).reshape(E, E).T)
  torch_mha.out_proj.bias.data = _t(p["out"]["bias"])


def _load_norm(torch_norm, p):
  torch_norm.weight.data = _t(p["scale"])
  torch_norm.bias.data = _t(p["bias"])


def _load_ffn(torch_layer, p):
  torch_layer.linear1.weight.data = _t(np.asarray(p["wi"]["kernel"]).T)
  torch_layer.linear1.bias.data = _t(p["wi"]["bias"])
  torch_layer.linear2.weight.data = _t(np.asarray(p["wo"]["kernel"]).T)
  torch_layer.linear2.bias.data = _t(p["wo"]["bias"])


def _load_encoder_layer(torch_layer, p):
  _load_attention(torch_layer.self_attn, p["self_attention"])
  _load_norm(torch_layer.norm1, p["self_attention_block"]["norm"])
  _load_ffn(torch_layer, p["ffn"])
  _load_norm(torch_layer.norm2, p["ffn_block"]["norm"])


def _load_decoder_layer(torch_layer, p):
  _load_attention(torch_layer.self_attn, p["self_attention"])
  _load_norm(torch_layer.norm1, p["self_attention_block"]["norm"])
  _load_attention(torch_layer.multihead_attn, p["cross_attention"])
  _load_norm(torch_layer.norm2, p["cross_attention_block"]["norm"])
  _load_ffn(torch_layer, p["ffn"])
  _load_norm(torch_layer.norm3, p["ffn_block"]["norm"])


def _data(seed=0):
  rng = np.random.default_rng(seed)
  src = rng.normal(size=(BATCH, SRC, E)).astype(np.float32)
  tgt = rng.normal(size=(BATCH, TGT, E)).astype(np.float32)
  src_valid = np.array([[1] * SRC, [1] * 4 + [0] * (SRC - 4)], bool)
  tgt_valid = np.array([[1] * TGT, [1] * 3 + [0] * (TGT - 3)], bool)
  return src, tgt, src_valid, tgt_valid


def _masks(src_valid, tgt_valid):
  s, t = jnp.asarray(src_valid, jnp.int32), jnp.asarray(tgt_valid, jnp.int32)
  encoder_mask = attention.padding_mask(s, s)
  self_mask = attention.combine_masks(attention.padding_mask(t, t), attention.causal_mask(TGT))
  cross_mask = attention.padding_mask(t, s)
  return encoder_mask, self_mask, cross_mask


def _close(ours, theirs, valid):
  np.testing.assert_allclose(np.asarray(ours)[valid], theirs.detach().numpy()[valid],
                             rtol=1e-5, atol=1e-5)


def test_multi_head_attention_matches_torch():
  src, tgt, src_valid, _ = _data()
  mha = attention.MultiHeadAttention(HEADS, E)
  params = nn.meta.unbox(mha.init(jax.random.PRNGKey(0), tgt, src)["params"])
  mask = jnp.asarray(src_valid)[:, None, None, :]
  ours = mha.apply({"params": params}, tgt, src, mask)
  torch_mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=True)
  _load_attention(torch_mha, params)
  theirs, _ = torch_mha(_t(tgt), _t(src), _t(src), key_padding_mask=torch.tensor(~src_valid))
  _close(ours, theirs, np.ones((BATCH, TGT), bool))


@pytest.mark.parametrize("pre_ln", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(pre_ln, activation):
  src, _, src_valid, tgt_valid = _data(1)
  config = _config(pre_ln, activation)
  layer = blocks.EncoderLayer(config)
  encoder_mask, _, _ = _masks(src_valid, tgt_valid)
  params = nn.meta.unbox(layer.init(jax.random.PRNGKey(1), src, encoder_mask, True)["params"])
  ours = layer.apply({"params": params}, src, encoder_mask, True)
  torch_layer = torch.nn.TransformerEncoderLayer(E, HEADS, FF, dropout=0.0, batch_first=True,
                                                 norm_first=pre_ln, activation=activation)
  _load_encoder_layer(torch_layer, params)
  torch_layer.eval()
  theirs = torch_layer(_t(src), src_key_padding_mask=torch.tensor(~src_valid))
  _close(ours, theirs, src_valid)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_decoder_layer_matches_torch(pre_ln):
  src, tgt, src_valid, tgt_valid = _data(2)
  config = _config(pre_ln)
  layer = blocks.DecoderLayer(config)
  _, self_mask, cross_mask = _masks(src_valid, tgt_valid)
  params = nn.meta.unbox(layer.init(jax.random.PRNGKey(2), tgt, src, self_mask, cross_mask,
                                    True, False)["params"])
  ours = layer.apply({"params": params}, tgt, src, self_mask, cross_mask, True, False)
  torch_layer = torch.nn.TransformerDecoderLayer(E, HEADS, FF, dropout=0.0, batch_first=True,
                                                 norm_first=pre_ln)
  _load_decoder_layer(torch_layer, params)
  torch_layer.eval()
  causal = torch.nn.Transformer.generate_square_subsequent_mask(TGT).isinf()
  theirs = torch_layer(_t(tgt), _t(src), tgt_mask=causal, tgt_is_causal=True,
                       tgt_key_padding_mask=torch.tensor(~tgt_valid),
                       memory_key_padding_mask=torch.tensor(~src_valid))
  _close(ours, theirs, tgt_valid)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_whole_transformer_matches_torch(pre_ln):
  """Embeddings + positions + our stacks + tied output vs the same around nn.Transformer.

  nn.Transformer always ends both stacks with a LayerNorm: final_norm=True here.
  """
  config = _config(pre_ln, layers=2, final_norm=True)
  model = models.EncoderDecoder(config)
  inputs = jnp.array([[5, 9, 12, 7, 3, 1, 1], [7, 8, 1, 0, 0, 0, 0]])
  targets = jnp.array([[11, 4, 13, 21, 1, 6], [6, 17, 1, 0, 0, 0]])
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(3), inputs, targets,
                                    deterministic=True)["params"])
  ours = model.apply({"params": params}, inputs, targets, deterministic=True)

  torch_model = torch.nn.Transformer(E, HEADS, 2, 2, FF, dropout=0.0, batch_first=True,
                                     norm_first=pre_ln)
  for i in range(2):
    _load_encoder_layer(torch_model.encoder.layers[i], params["encoder"][f"layer_{i}"])
    _load_decoder_layer(torch_model.decoder.layers[i], params["decoder"][f"layer_{i}"])
  _load_norm(torch_model.encoder.norm, params["encoder"]["final_norm"])
  _load_norm(torch_model.decoder.norm, params["decoder"]["final_norm"])
  torch_model.eval()

  embedding = np.asarray(params["shared_embedding"]["embedding"]["embedding"])
  from transformer_jax.model import layers
  table = layers.sinusoidal_positions(32, E)
  embed = lambda ids: _t(embedding[np.asarray(ids)] * np.sqrt(E) + table[:ids.shape[1]])
  decoder_inputs = models.shift_right(targets, config.bos_id)
  src_pad = torch.tensor(np.asarray(inputs) == 0)
  tgt_pad = torch.tensor(np.asarray(targets) == 0)
  causal = torch.nn.Transformer.generate_square_subsequent_mask(targets.shape[1]).isinf()
  hidden = torch_model(embed(inputs), embed(decoder_inputs), tgt_mask=causal, tgt_is_causal=True,
                       src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                       memory_key_padding_mask=src_pad)
  theirs = hidden @ _t(embedding).T
  _close(ours, theirs, np.asarray(targets) != 0)
