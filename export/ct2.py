"""Export to CTranslate2: a model directory that `ctranslate2.Translator` loads.

Written from our weights directly (not through CTranslate2's Marian converter, which assumes Marian's own
conventions: decoding starts from a zero embedding and the last vocabulary entry is padding), so it also
takes pre-norm, learned positions and unshared embeddings, and keeps our LayerNorm epsilon.

Requires the `interop` extra (ctranslate2).
"""
from __future__ import annotations

import math
import pathlib
import shutil

import numpy as np

from export.weights import check_exportable, neutral_weights, pieces_of
from model.config import TransformerConfig


def ctranslate2_spec(params, cfg: TransformerConfig, vocab, pieces: list[str], *, source_eos: bool = False):
  """Our params -> a ctranslate2 TransformerSpec with vocabularies and config filled in.

  pieces: the token string of every id (CTranslate2 takes and returns token strings).
  source_eos: the run's config.data.source_eos. CTranslate2 then appends EOS to every source itself
  (config.json's add_source_eos), so that a user's source pieces go in as the SentencePiece model cuts
  them. Our sources never start with BOS (add_source_bos is always false).
  """
  from ctranslate2.specs import common_spec, transformer_spec
  check_exportable(cfg, "ctranslate2")
  w = neutral_weights(params, cfg)
  spec = transformer_spec.TransformerSpec.from_config(
      (cfg.num_encoder_layers, cfg.num_decoder_layers), cfg.num_heads, pre_norm=cfg.pre_norm,
      activation=common_spec.Activation.SWISH if cfg.activation == "swish" else common_spec.Activation.RELU)

  def linear(spec_, name):
    spec_.weight = w[f"{name}.weight"]
    spec_.bias = w[f"{name}.bias"]

  def fused(spec_, names):
    spec_.weight = np.concatenate([w[f"{n}.weight"] for n in names], axis=0)
    spec_.bias = np.concatenate([w[f"{n}.bias"] for n in names], axis=0)

  def norm(spec_, name):
    spec_.gamma = w[f"{name}.weight"]
    spec_.beta = w[f"{name}.bias"]

  for stack, stack_spec in (("encoder", spec.encoder), ("decoder", spec.decoder)):
    embeddings = stack_spec.embeddings[0] if stack == "encoder" else stack_spec.embeddings
    embeddings.weight = w[f"{stack}.embed_tokens.weight"]
    stack_spec.scale_embeddings = math.sqrt(cfg.d_model)
    stack_spec.position_encodings.encodings = w[f"{stack}.embed_positions.weight"]
    if cfg.pre_norm:
      norm(stack_spec.layer_norm, f"{stack}.layer_norm")
    for i, layer in enumerate(stack_spec.layer):
      prefix = f"{stack}.layers.{i}"
      attn = f"{prefix}.self_attn"
      fused(layer.self_attention.linear[0], [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"])
      linear(layer.self_attention.linear[1], f"{attn}.out_proj")
      norm(layer.self_attention.layer_norm, f"{prefix}.self_attn_layer_norm")
      if stack == "decoder":
        cross = f"{prefix}.encoder_attn"
        linear(layer.attention.linear[0], f"{cross}.q_proj")
        fused(layer.attention.linear[1], [f"{cross}.k_proj", f"{cross}.v_proj"])
        linear(layer.attention.linear[2], f"{cross}.out_proj")
        norm(layer.attention.layer_norm, f"{prefix}.encoder_attn_layer_norm")
      linear(layer.ffn.linear_0, f"{prefix}.fc1")
      linear(layer.ffn.linear_1, f"{prefix}.fc2")
      norm(layer.ffn.layer_norm, f"{prefix}.final_layer_norm")
  spec.decoder.projection.weight = w["lm_head.weight"]
  if cfg.logits_bias:
    spec.decoder.projection.bias = np.asarray(params["final_logits_bias"], np.float32)

  spec.config.layer_norm_epsilon = float(cfg.layer_norm_epsilon)
  spec.config.unk_token = pieces[vocab.unk_id]
  spec.config.bos_token = pieces[vocab.bos_id]
  spec.config.eos_token = pieces[vocab.eos_id]
  spec.config.decoder_start_token = pieces[vocab.bos_id]
  spec.config.add_source_bos = False
  spec.config.add_source_eos = bool(source_eos)
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  return spec


def save_ctranslate2(spec, out_dir, quantization: str | None = None) -> pathlib.Path:
  """Validates `spec` and writes it as a CTranslate2 model directory (replacing `out_dir`)."""
  from ctranslate2.converters.converter import Converter

  class _FromSpec(Converter):
    def _load(self):
      return spec

  return pathlib.Path(_FromSpec().convert(str(out_dir), quantization=quantization, force=True))


def export_ctranslate2(params, cfg: TransformerConfig, vocab, spm_path, out_dir,
                       quantization: str | None = None, *, source_eos: bool = False) -> pathlib.Path:
  """Writes a CTranslate2 model directory (model.bin, config.json, vocabularies) plus the run's
  SentencePiece model as source.spm / target.spm for tokenizing. Returns the directory.

  `ctranslate2.Translator(out_dir)` loads it; it takes SentencePiece pieces as tokens, and appends EOS
  to them itself where the run was trained with source_eos.
  """
  pair = getattr(vocab, "spm_bytes", None)   # a PairVocab (data/vocab.py): its two models and id table
  pieces = list(vocab.pieces) if pair else pieces_of(spm_path, vocab)
  spec = ctranslate2_spec(params, cfg, vocab, pieces, source_eos=source_eos)
  out = save_ctranslate2(spec, out_dir, quantization)
  for side in ("source", "target"):
    if pair:
      (out / f"{side}.spm").write_bytes(pair[side])
    else:
      shutil.copyfile(spm_path, out / f"{side}.spm")
  return out
