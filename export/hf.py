"""Export to Hugging Face: a model directory that `AutoModelForSeq2SeqLM.from_pretrained` loads.

One class per layer order, each holding our model exactly (docs/runs.md compares the candidates):
- post-norm (the paper's): MarianMTModel, Marian's Transformer with its sin-first sinusoids;
- pre-norm: PegasusForConditionalGeneration, the same layers with the LayerNorm before each sublayer
  and one after each stack, as ours. MBart adds a LayerNorm after the embeddings (layernorm_embedding,
  not optional); M2M100 and NLLB compute fairseq's sinusoids (another frequency scale, positions
  counted from pad + 1); Bart and FSMT are post-norm.
Both take our numbers as they are: token tables shared or not (Marian's share_encoder_decoder_embeddings,
Pegasus's untied embeddings), sinusoidal or learned positions (the position table is a stored weight in
both; the export reloads the directory and checks every weight), bias-free attention as zero biases.
The one inexact part: both classes hard-code LayerNorm epsilon 1e-5 (ours defaults to 1e-6); the export
prints the difference.

The tokenizer is MarianTokenizer over the run's SentencePiece model. It appends </s> to every source,
which is the run's convention when config.data.source_eos is true; when it is false, call it with
add_special_tokens=False (README.md in the directory gives the exact calls).

Requires the `interop` extra (torch, transformers, safetensors).
"""
from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np

from export.interop import need
from export.weights import check_exportable, neutral_weights, pieces_of
from model.config import TransformerConfig

HF_LAYER_NORM_EPSILON = 1e-5   # nn.LayerNorm's default, which Marian's and Pegasus's layers use
# Our sinusoids' angles are float32 products, Marian's float64: at position 511 of d_model 512 they differ
# by 4e-5 (2e-5 at position 255 of d_model 128).
SINUSOID_TOLERANCE = 1e-4


def hf_class_name(cfg: TransformerConfig) -> str:
  """The transformers class that holds `cfg`: Pegasus for pre-norm, Marian for post-norm."""
  return "PegasusForConditionalGeneration" if cfg.pre_norm else "MarianMTModel"


def hf_config(cfg: TransformerConfig, vocab):
  """The transformers MarianConfig or PegasusConfig equivalent to `cfg` (with the vocabulary's ids)."""
  transformers = need("transformers")
  common = dict(
      vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_len, d_model=cfg.d_model,
      encoder_layers=cfg.num_encoder_layers, decoder_layers=cfg.num_decoder_layers,
      encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
      encoder_attention_heads=cfg.num_heads, decoder_attention_heads=cfg.num_heads,
      activation_function=cfg.activation, scale_embedding=True,      # x * sqrt(d_model), as ours
      dropout=cfg.dropout_rate, attention_dropout=cfg.attention_dropout_rate,
      activation_dropout=cfg.relu_dropout_rate, tie_word_embeddings=cfg.share_embeddings,
      pad_token_id=vocab.pad_id, eos_token_id=vocab.eos_id, bos_token_id=vocab.bos_id,
      # Our decoder starts from bos (Marian's and Pegasus's own models start from pad); no forced eos at
      # max_length, so that generate() stops exactly where our search does.
      decoder_start_token_id=vocab.bos_id, forced_eos_token_id=None,
      architectures=[hf_class_name(cfg)])
  if cfg.pre_norm:
    return transformers.PegasusConfig(**common)
  return transformers.MarianConfig(decoder_vocab_size=cfg.vocab_size,
                                   share_encoder_decoder_embeddings=cfg.share_embeddings, **common)


def hf_state(params, cfg: TransformerConfig) -> dict:
  """Our params -> the state dict (float32 torch tensors) of hf_class_name(cfg)."""
  torch = need("torch")
  state = {}
  for name, array in neutral_weights(params, cfg).items():
    key = name if name == "lm_head.weight" else f"model.{name}"
    state[key] = torch.from_numpy(np.array(array, np.float32))   # writable copy
  # Pegasus keeps `shared` even when the stacks have their own tables (then it is unused); to_hf drops it
  # for Marian, which has none then.
  state["model.shared.weight"] = state["model.encoder.embed_tokens.weight"]
  bias = np.array(params["final_logits_bias"], np.float32) if cfg.logits_bias else np.zeros(cfg.vocab_size,
                                                                                                np.float32)
  state["final_logits_bias"] = torch.from_numpy(bias.reshape(1, cfg.vocab_size))
  return state


def to_hf(params, cfg: TransformerConfig, vocab):
  """Our params -> a transformers MarianMTModel or PegasusForConditionalGeneration (float32, eval mode)
  computing the same function."""
  transformers = need("transformers")
  check_exportable(cfg, "hf")
  model = getattr(transformers, hf_class_name(cfg))(hf_config(cfg, vocab))
  state = hf_state(params, cfg)
  if "model.shared.weight" not in model.state_dict():   # Marian with unshared tables has none
    del state["model.shared.weight"]
  missing, unexpected = model.load_state_dict(state, strict=False)
  if missing or unexpected:
    raise RuntimeError(f"weight names do not match {hf_class_name(cfg)}: missing {missing}, "
                       f"unexpected {unexpected}")
  if cfg.layer_norm_epsilon != HF_LAYER_NORM_EPSILON:
    print(f"note: {hf_class_name(cfg)}'s LayerNorm epsilon is {HF_LAYER_NORM_EPSILON}; this model was "
          f"trained with {cfg.layer_norm_epsilon} (the only inexact part of the Hugging Face export)",
          file=sys.stderr)
  return model.eval()


def to_marian(params, cfg: TransformerConfig, vocab):
  """to_hf for a post-norm model (kept for callers that name Marian)."""
  if cfg.pre_norm:
    raise ValueError("to_marian: a pre-norm model exports as Pegasus; call to_hf")
  return to_hf(params, cfg, vocab)


def _check_reloaded(out: pathlib.Path, model) -> None:
  """Loads `out` as a user would and checks that every weight came back. Marian recomputes its sinusoids
  on loading (in float64, so they differ from ours by float32 rounding); Pegasus keeps the stored table,
  which is what makes learned positions exportable."""
  torch = need("torch")
  transformers = need("transformers")
  reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(out)
  if type(reloaded) is not type(model):
    raise RuntimeError(f"{out} loads as {type(reloaded).__name__}, not {type(model).__name__}")
  theirs = reloaded.state_dict()
  for name, tensor in model.state_dict().items():
    marian_positions = "embed_positions" in name and isinstance(model, transformers.MarianMTModel)
    tol = SINUSOID_TOLERANCE if marian_positions else 0.0
    if name not in theirs or not torch.allclose(theirs[name], tensor, rtol=0.0, atol=tol):
      raise RuntimeError(f"{out}: weight {name} did not survive save_pretrained / from_pretrained")


def export_hf(params, cfg: TransformerConfig, vocab, spm_path, out_dir, *, beam_size=None,
              alpha=None) -> pathlib.Path:
  """Writes a model directory: config.json, generation_config.json, model.safetensors, source.spm /
  target.spm (the run's SentencePiece model), vocab.json, tokenizer_config.json.

  beam_size, alpha: the run's config.decode, as generation_config's num_beams and
  length_penalty (Hugging Face's length penalty is L^alpha, ours GNMT's). Returns the directory.
  """
  MarianTokenizer = need("transformers").MarianTokenizer
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  pair = getattr(vocab, "spm_bytes", None)   # a PairVocab (data/vocab.py): its two models and id table
  pieces = list(vocab.pieces) if pair else pieces_of(spm_path, vocab)
  model = to_hf(params, cfg, vocab)
  generation = model.generation_config
  generation.max_length = cfg.max_len
  generation.forced_eos_token_id = None
  if beam_size:
    generation.num_beams = int(beam_size)
  if alpha is not None:
    generation.length_penalty = float(alpha)
  model.save_pretrained(out, safe_serialization=True)
  _check_reloaded(out, model)
  (out / "vocab.json").write_text(json.dumps({piece: i for i, piece in enumerate(pieces)},
                                             ensure_ascii=False, indent=0) + "\n")
  for side in ("source", "target"):
    if pair:
      (out / f"{side}.spm").write_bytes(pair[side])
    else:
      shutil.copyfile(spm_path, out / f"{side}.spm")
  tokenizer = MarianTokenizer(
      source_spm=str(out / "source.spm"), target_spm=str(out / "target.spm"), vocab=str(out / "vocab.json"),
      unk_token=pieces[vocab.unk_id], eos_token=pieces[vocab.eos_id], pad_token=pieces[vocab.pad_id],
      bos_token=pieces[vocab.bos_id],   # special, so that batch_decode(skip_special_tokens=True) drops it
      model_max_length=cfg.max_len)
  tokenizer.save_pretrained(out)
  return out
