"""What both export formats share: the checks, the d_model permutation to Marian's layout, our
parameters as one neutral dict of float32 arrays with Marian's names, and the vocabulary's pieces.

Both formats hold the same numbers as our model, converted exactly:
- Our sinusoids interleave sin and cos (dims 2i, 2i+1); Marian puts every sin first, then every cos. One
  permutation of the d_model axis, applied to every weight that reads or writes the residual stream,
  turns one layout into the other; LayerNorm and the tied output projection do not care about the order
  of the dimensions, so the converted model computes the same function.
- Bias-free attention projections become zero biases.
"""
from __future__ import annotations

import numpy as np
import sentencepiece as spm

from model.config import ANY, TransformerConfig, unimplemented
from model.embedding import sinusoid

# Each format's own declaration of what it holds (model.config.unimplemented reads it: {field: ANY, the
# values it takes, or a predicate of the config}): today both hold the paper's encoder-decoder with
# Marian's switches. A model that sets any other field (a switch added after these lists included) is
# refused by that format, naming it; declaring a field for one format declares it for no other.
HF = dict(dict.fromkeys((
    "vocab_size", "d_model", "d_ff", "num_heads", "d_k", "d_v", "num_encoder_layers", "num_decoder_layers",
    "dropout_rate", "attention_dropout_rate", "relu_dropout_rate", "max_len", "param_dtype", "pre_norm",
    "share_embeddings", "attention_bias", "layer_norm_epsilon", "logits_bias", "compute",
    # read only with positions="relative" or arch="encoder_only", which are refused
    "relative_buckets", "relative_max_distance", "num_classes"), ANY),
    arch=("encoder_decoder",), positions=("sinusoidal", "learned"),
    num_kv_heads=lambda cfg: cfg.kv_heads == cfg.num_heads,
    activation=("relu", "swish"), norm=("layernorm",))   # swish: Marian's SiLU
CTRANSLATE2 = dict(dict.fromkeys((
    "vocab_size", "d_model", "d_ff", "num_heads", "d_k", "d_v", "num_encoder_layers", "num_decoder_layers",
    "dropout_rate", "attention_dropout_rate", "relu_dropout_rate", "max_len", "param_dtype", "pre_norm",
    "share_embeddings", "attention_bias", "layer_norm_epsilon", "logits_bias", "compute",
    "relative_buckets", "relative_max_distance", "num_classes"), ANY),
    arch=("encoder_decoder",), positions=("sinusoidal", "learned"),
    num_kv_heads=lambda cfg: cfg.kv_heads == cfg.num_heads,
    activation=("relu", "swish"), norm=("layernorm",))
IMPLEMENTS = {"hf": HF, "ctranslate2": CTRANSLATE2}
FORMATS = tuple(IMPLEMENTS)


class UnsupportedOption(ValueError):
  """The model uses an option the target format cannot express."""


# ----------------------------------------------------------------------------------------------------
# Checks and the d_model permutation.
# ----------------------------------------------------------------------------------------------------
def check_exportable(cfg: TransformerConfig, fmt: str) -> None:
  """Raises UnsupportedOption naming every option of `cfg` that format `fmt` cannot express exactly."""
  if fmt not in FORMATS:
    raise ValueError(f"unknown export format {fmt!r}; use one of {FORMATS}")
  problems = []
  head_dim = cfg.d_model // cfg.num_heads
  if cfg.head_dim_k != cfg.head_dim_v:
    problems.append(f"d_k={cfg.head_dim_k} != d_v={cfg.head_dim_v} (both formats need one head size)")
  if fmt == "hf" and (cfg.d_model % cfg.num_heads or cfg.head_dim_k != head_dim):
    problems.append(f"d_k={cfg.head_dim_k} with d_model={cfg.d_model}, num_heads={cfg.num_heads} "
                    f"(Marian's and Pegasus's head size is d_model / num_heads)")
  if fmt == "hf" and cfg.positions == "learned" and not cfg.pre_norm:
    problems.append("learned positions with post-norm (MarianMTModel recomputes its sinusoids when it "
                    "loads; a pre-norm model exports as Pegasus, which keeps the table; or export to "
                    "ctranslate2)")
  problems += [f"{option} (the {fmt} export holds the paper's model with Marian's switches: "
               f"export/weights.py's {fmt.upper()})" for option in unimplemented(cfg, IMPLEMENTS[fmt])]
  if cfg.positions != "learned" and cfg.d_model % 2:
    problems.append(f"odd d_model={cfg.d_model}")
  if problems:
    raise UnsupportedOption(f"cannot export this model to {fmt}: unsupported option(s): "
                            + "; ".join(problems))


def marian_permutation(d_model: int) -> np.ndarray:
  """Indices `perm` with marian_vector = our_vector[perm]: even dims (sin) first, then odd dims (cos)."""
  return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


# ----------------------------------------------------------------------------------------------------
# Our parameters -> one neutral dict in PyTorch's layout (Linear weight [out, in]), Marian's names.
# ----------------------------------------------------------------------------------------------------
def _np(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float32)


def _attention(p: dict, prefix: str, cfg: TransformerConfig, perm: np.ndarray) -> dict:
  """One MultiHeadAttention's params -> q/k/v/out_proj weights [out, in] and biases, permuted."""
  d = cfg.d_model
  out = {}
  for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
    kernel = _np(p[ours]["kernel"])                                   # [d_model, h, d_head]
    width = kernel.shape[1] * kernel.shape[2]
    out[f"{prefix}.{theirs}.weight"] = kernel.reshape(d, width).T[:, perm]          # [h*d_head, d_model]
    bias = p[ours].get("bias")
    out[f"{prefix}.{theirs}.bias"] = (_np(bias).reshape(width) if bias is not None
                                      else np.zeros(width, np.float32))
  kernel = _np(p["out"]["kernel"])                                    # [h, d_v, d_model]
  out[f"{prefix}.out_proj.weight"] = kernel.reshape(-1, d).T[perm, :]               # [d_model, h*d_v]
  bias = p["out"].get("bias")
  out[f"{prefix}.out_proj.bias"] = _np(bias)[perm] if bias is not None else np.zeros(d, np.float32)
  return out


def _norm(p: dict, name: str, perm: np.ndarray) -> dict:
  return {f"{name}.weight": _np(p["norm"]["scale"])[perm], f"{name}.bias": _np(p["norm"]["bias"])[perm]}


def _ffn(p: dict, prefix: str, perm: np.ndarray) -> dict:
  return {f"{prefix}.fc1.weight": _np(p["wi"]["kernel"]).T[:, perm],    # [d_ff, d_model]
          f"{prefix}.fc1.bias": _np(p["wi"]["bias"]),
          f"{prefix}.fc2.weight": _np(p["wo"]["kernel"]).T[perm, :],    # [d_model, d_ff]
          f"{prefix}.fc2.bias": _np(p["wo"]["bias"])[perm]}


def neutral_weights(params, cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """Our params -> {Marian-style name: float32 array}, d_model axes permuted to Marian's layout.

  Names (without Marian's 'model.' prefix): 'encoder.embed_tokens.weight' [vocab, d_model],
  'decoder.embed_tokens.weight', 'lm_head.weight' [vocab, d_model] (the same array when embeddings are
  shared), per layer 'encoder.layers.{i}.self_attn.q_proj.weight' etc. Extra keys for formats that take
  them: 'encoder.embed_positions.weight' / 'decoder.embed_positions.weight' [max_len, d_model].
  """
  perm = marian_permutation(cfg.d_model)
  out = {}
  if cfg.share_embeddings:
    table = _np(params["shared_embedding"]["embedding"])[:, perm]          # [vocab, d_model]
    out["encoder.embed_tokens.weight"] = out["decoder.embed_tokens.weight"] = table
    out["lm_head.weight"] = table
  else:
    out["encoder.embed_tokens.weight"] = _np(params["encoder"]["embed"]["table"]["embedding"])[:, perm]
    out["decoder.embed_tokens.weight"] = _np(params["decoder"]["embed"]["table"]["embedding"])[:, perm]
    out["lm_head.weight"] = _np(params["output_projection"]["kernel"]).T[:, perm]   # [vocab, d_model]
  for stack in ("encoder", "decoder"):
    if cfg.positions == "learned":
      positions = _np(params[stack]["embed"]["positions"]["embedding"])             # [max_len, d_model]
    else:
      positions = np.asarray(sinusoid(np.arange(cfg.max_len), cfg.d_model), np.float32)
    out[f"{stack}.embed_positions.weight"] = positions[:, perm]
    if cfg.pre_norm:
      out[f"{stack}.layer_norm.weight"] = _np(params[stack]["final_norm"]["scale"])[perm]
      out[f"{stack}.layer_norm.bias"] = _np(params[stack]["final_norm"]["bias"])[perm]
  for i in range(cfg.num_encoder_layers):
    p, prefix = params["encoder"][f"layers_{i}"], f"encoder.layers.{i}"
    out.update(_attention(p["self_attention"], f"{prefix}.self_attn", cfg, perm))
    out.update(_norm(p["residual_attention"], f"{prefix}.self_attn_layer_norm", perm))
    out.update(_ffn(p["ffn"], prefix, perm))
    out.update(_norm(p["residual_ffn"], f"{prefix}.final_layer_norm", perm))
  for i in range(cfg.num_decoder_layers):
    p, prefix = params["decoder"][f"layers_{i}"], f"decoder.layers.{i}"
    out.update(_attention(p["self_attention"], f"{prefix}.self_attn", cfg, perm))
    out.update(_norm(p["residual_self"], f"{prefix}.self_attn_layer_norm", perm))
    out.update(_attention(p["cross_attention"], f"{prefix}.encoder_attn", cfg, perm))
    out.update(_norm(p["residual_cross"], f"{prefix}.encoder_attn_layer_norm", perm))
    out.update(_ffn(p["ffn"], prefix, perm))
    out.update(_norm(p["residual_ffn"], f"{prefix}.final_layer_norm", perm))
  return out


# ----------------------------------------------------------------------------------------------------
# Vocabulary: our ids are the SentencePiece ids of the run's vocab.model.
# ----------------------------------------------------------------------------------------------------
def pieces_of(spm_path, vocab) -> list[str]:
  """Every id's SentencePiece piece, id order; checks the model file against the Vocab."""
  processor = spm.SentencePieceProcessor(model_file=str(spm_path))
  size = processor.get_piece_size()
  if size != vocab.size:
    raise ValueError(f"{spm_path} has {size} pieces but the vocabulary has {vocab.size}: "
                     f"export from the run directory the model was trained with")
  pieces = [processor.id_to_piece(i) for i in range(size)]
  if len(set(pieces)) != size:
    raise ValueError(f"{spm_path}: pieces are not unique, so token strings cannot name ids")
  return pieces


# ----------------------------------------------------------------------------------------------------
# The reverse: a neutral dict (Marian's names and layout) -> our params (export/load_hf.py).
# ----------------------------------------------------------------------------------------------------
def _attention_from(w: dict, prefix: str, cfg: TransformerConfig, inv: np.ndarray) -> dict:
  d, h = cfg.d_model, cfg.num_heads
  out = {}
  for ours, theirs, d_head in (("query", "q_proj", cfg.head_dim_k), ("key", "k_proj", cfg.head_dim_k),
                               ("value", "v_proj", cfg.head_dim_v)):
    weight = w[f"{prefix}.{theirs}.weight"]                                        # [h*d_head, d_model]
    out[ours] = {"kernel": weight[:, inv].T.reshape(d, h, d_head),                 # [d_model, h, d_head]
                 "bias": w[f"{prefix}.{theirs}.bias"].reshape(h, d_head)}
  weight = w[f"{prefix}.out_proj.weight"]                                          # [d_model, h*d_v]
  out["out"] = {"kernel": weight[inv, :].T.reshape(h, cfg.head_dim_v, d),          # [h, d_v, d_model]
                "bias": w[f"{prefix}.out_proj.bias"][inv]}
  return out


def _norm_from(w: dict, name: str, inv: np.ndarray) -> dict:
  return {"norm": {"scale": w[f"{name}.weight"][inv], "bias": w[f"{name}.bias"][inv]}}


def _ffn_from(w: dict, prefix: str, inv: np.ndarray) -> dict:
  return {"wi": {"kernel": w[f"{prefix}.fc1.weight"][:, inv].T, "bias": w[f"{prefix}.fc1.bias"]},
          "wo": {"kernel": w[f"{prefix}.fc2.weight"][inv, :].T, "bias": w[f"{prefix}.fc2.bias"][inv]}}


def params_from_neutral(w: dict, cfg: TransformerConfig) -> dict:
  """neutral_weights's inverse: {Marian-style name: float32 array} -> our (unrolled) params.

  With cfg.share_embeddings, 'encoder.embed_tokens.weight' is the shared table; with cfg.positions
  'learned', the position tables are read, else they are our sinusoids (the caller checks they are).
  'final_logits_bias' [vocab] is read where cfg.logits_bias is set.
  """
  inv = np.argsort(marian_permutation(cfg.d_model))
  w = {name: _np(array) for name, array in w.items()}
  params = {}
  if cfg.share_embeddings:
    params["shared_embedding"] = {"embedding": w["encoder.embed_tokens.weight"][:, inv]}
  else:
    params["output_projection"] = {"kernel": w["lm_head.weight"][:, inv].T}         # [d_model, vocab]
  if cfg.logits_bias:
    params["final_logits_bias"] = w["final_logits_bias"]
  for stack in ("encoder", "decoder"):
    embed = {}
    if not cfg.share_embeddings:
      embed["table"] = {"embedding": w[f"{stack}.embed_tokens.weight"][:, inv]}
    if cfg.positions == "learned":
      embed["positions"] = {"embedding": w[f"{stack}.embed_positions.weight"][:, inv]}
    params[stack] = {"embed": embed} if embed else {}
    if cfg.pre_norm:
      params[stack]["final_norm"] = {"scale": w[f"{stack}.layer_norm.weight"][inv],
                                     "bias": w[f"{stack}.layer_norm.bias"][inv]}
  for i in range(cfg.num_encoder_layers):
    prefix = f"encoder.layers.{i}"
    params["encoder"][f"layers_{i}"] = {
        "self_attention": _attention_from(w, f"{prefix}.self_attn", cfg, inv),
        "residual_attention": _norm_from(w, f"{prefix}.self_attn_layer_norm", inv),
        "ffn": _ffn_from(w, prefix, inv),
        "residual_ffn": _norm_from(w, f"{prefix}.final_layer_norm", inv)}
  for i in range(cfg.num_decoder_layers):
    prefix = f"decoder.layers.{i}"
    params["decoder"][f"layers_{i}"] = {
        "self_attention": _attention_from(w, f"{prefix}.self_attn", cfg, inv),
        "residual_self": _norm_from(w, f"{prefix}.self_attn_layer_norm", inv),
        "cross_attention": _attention_from(w, f"{prefix}.encoder_attn", cfg, inv),
        "residual_cross": _norm_from(w, f"{prefix}.encoder_attn_layer_norm", inv),
        "ffn": _ffn_from(w, prefix, inv),
        "residual_ffn": _norm_from(w, f"{prefix}.final_layer_norm", inv)}
  return params
