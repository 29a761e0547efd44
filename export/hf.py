"""Export to Hugging Face: a MarianMTModel directory that `MarianMTModel.from_pretrained` loads.

- Marian hard-codes LayerNorm epsilon 1e-5; a run with another epsilon (ours defaults to 1e-6) exports
  with that single change, and the export prints the difference it makes.
- Options Marian cannot express (pre-norm, learned positions, d_k or d_v other than d_model / num_heads)
  are refused with an error naming the option (export/weights.py:check_exportable).

Requires the `interop` extra (torch, transformers, safetensors).
"""
from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np

from export.weights import check_exportable, neutral_weights, pieces_of
from model.config import TransformerConfig

MARIAN_LAYER_NORM_EPSILON = 1e-5   # nn.LayerNorm's default, which Marian's layers use


def marian_config(cfg: TransformerConfig, vocab):
  """The transformers.MarianConfig equivalent to `cfg` (with the vocabulary's special ids)."""
  from transformers import MarianConfig
  return MarianConfig(
      vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size,
      max_position_embeddings=cfg.max_len, d_model=cfg.d_model,
      encoder_layers=cfg.num_encoder_layers, decoder_layers=cfg.num_decoder_layers,
      encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
      encoder_attention_heads=cfg.num_heads, decoder_attention_heads=cfg.num_heads,
      activation_function="relu", scale_embedding=True,              # x * sqrt(d_model), as ours
      dropout=cfg.dropout_rate, attention_dropout=cfg.attention_dropout_rate,
      activation_dropout=cfg.relu_dropout_rate,
      share_encoder_decoder_embeddings=cfg.share_embeddings, tie_word_embeddings=cfg.share_embeddings,
      pad_token_id=vocab.pad_id, eos_token_id=vocab.eos_id, bos_token_id=vocab.bos_id,
      # Our decoder starts from bos (Marian's own models start from pad); no forced eos at max_length,
      # so that generate() stops exactly where our search does.
      decoder_start_token_id=vocab.bos_id, forced_eos_token_id=None,
      architectures=["MarianMTModel"])


def to_marian(params, cfg: TransformerConfig, vocab):
  """Our params -> a transformers.MarianMTModel (float32, eval mode) computing the same function."""
  import torch
  from transformers import MarianMTModel
  check_exportable(cfg, "hf")
  weights = neutral_weights(params, cfg)
  model = MarianMTModel(marian_config(cfg, vocab))
  state = {}
  for name, array in weights.items():
    if "embed_positions" in name:
      continue                        # Marian computes its own sinusoids
    key = name if name == "lm_head.weight" else f"model.{name}"
    state[key] = torch.from_numpy(np.array(array, np.float32))   # writable copy
  if cfg.share_embeddings:
    state["model.shared.weight"] = state["model.encoder.embed_tokens.weight"]
  missing, unexpected = model.load_state_dict(state, strict=False)
  missing = [k for k in missing if "embed_positions" not in k and k != "final_logits_bias"]
  if missing or unexpected:
    raise RuntimeError(f"weight names do not match MarianMTModel: missing {missing}, "
                       f"unexpected {unexpected}")
  with torch.no_grad():
    model.final_logits_bias.zero_()
  if cfg.layer_norm_epsilon != MARIAN_LAYER_NORM_EPSILON:
    print(f"note: Marian's LayerNorm epsilon is {MARIAN_LAYER_NORM_EPSILON}; this model was trained with "
          f"{cfg.layer_norm_epsilon} (the only inexact part of the Hugging Face export)", file=sys.stderr)
  return model.eval()


def export_hf(params, cfg: TransformerConfig, vocab, spm_path, out_dir, *, beam_size=None) -> pathlib.Path:
  """Writes a MarianMTModel directory: config.json, generation_config.json, model.safetensors,
  source.spm / target.spm (the run's SentencePiece model), vocab.json, tokenizer_config.json.

  Returns the directory. `MarianMTModel.from_pretrained(out_dir)` and `MarianTokenizer.from_pretrained`
  load it.
  """
  from transformers import MarianTokenizer
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  pieces = pieces_of(spm_path, vocab)
  model = to_marian(params, cfg, vocab)
  generation = model.generation_config
  generation.max_length = cfg.max_len
  generation.forced_eos_token_id = None
  if beam_size:
    generation.num_beams = int(beam_size)
  model.save_pretrained(out, safe_serialization=True)
  (out / "vocab.json").write_text(json.dumps({piece: i for i, piece in enumerate(pieces)},
                                             ensure_ascii=False, indent=0) + "\n")
  for name in ("source.spm", "target.spm"):
    shutil.copyfile(spm_path, out / name)
  tokenizer = MarianTokenizer(
      source_spm=str(out / "source.spm"), target_spm=str(out / "target.spm"), vocab=str(out / "vocab.json"),
      unk_token=pieces[vocab.unk_id], eos_token=pieces[vocab.eos_id], pad_token=pieces[vocab.pad_id],
      model_max_length=cfg.max_len)
  tokenizer.save_pretrained(out)
  return out
