"""Export a trained run to Hugging Face (a MarianMTModel directory) or to CTranslate2.

    python -m decode.export --workdir RUN [--checkpoint STEP|averaged] --format hf|ctranslate2 --out DIR

Both formats hold the same numbers as our model, converted exactly:
- Our sinusoids interleave sin and cos (dims 2i, 2i+1); Marian puts every sin first, then every cos. One
  permutation of the d_model axis, applied to every weight that reads or writes the residual stream,
  turns one layout into the other; LayerNorm and the tied output projection do not care about the order
  of the dimensions, so the converted model computes the same function.
- Bias-free attention projections become zero biases.
- Marian hard-codes LayerNorm epsilon 1e-5; a run with another epsilon (ours defaults to 1e-6) exports
  with that single change, and the export prints the difference it makes. CTranslate2 keeps our epsilon.
Options Marian cannot express (pre-norm, learned positions, d_k or d_v other than d_model / num_heads) are
refused with an error naming the option. CTranslate2 is written from our weights directly (not through
its Marian converter, which assumes Marian's own conventions: decoding starts from a zero embedding and
the last vocabulary entry is padding), so it also takes pre-norm, learned positions and unshared
embeddings.

Requires the `interop` extra: pip install -e '.[interop]'.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import sys

import numpy as np

from model.config import TransformerConfig, as_dtype
from model.embedding import sinusoid

FORMATS = ("hf", "ctranslate2")
MARIAN_LAYER_NORM_EPSILON = 1e-5   # nn.LayerNorm's default, which Marian's layers use


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
  if fmt == "hf":
    if cfg.pre_norm:
      problems.append("pre_norm=True (Marian is post-norm only; export to ctranslate2 instead)")
    if cfg.learned_positions:
      problems.append("learned_positions=True (Marian has sinusoidal positions only; export to "
                      "ctranslate2 instead)")
    if cfg.d_model % cfg.num_heads or cfg.head_dim_k != head_dim:
      problems.append(f"d_k={cfg.head_dim_k} with d_model={cfg.d_model}, num_heads={cfg.num_heads} "
                      f"(Marian's head size is d_model / num_heads)")
  # The family switches (docs/family.md): both formats hold the paper's encoder-decoder only.
  defaults = dict(arch="encoder_decoder", num_kv_heads=None, activation="relu", norm="layernorm")
  for name, default in defaults.items():
    if getattr(cfg, name) not in (default, cfg.num_heads if name == "num_kv_heads" else default):
      problems.append(f"{name}={getattr(cfg, name)!r} (the {fmt} export holds {name}={default!r} only)")
  if cfg.positions not in ("sinusoidal", "learned"):
    problems.append(f"positions={cfg.positions!r} (the {fmt} export holds sinusoidal or learned "
                    f"positions only)")
  elif cfg.positions == "learned" and fmt == "hf" and not cfg.learned_positions:
    problems.append("positions='learned' (Marian has sinusoidal positions only; export to ctranslate2 "
                    "instead)")
  if not cfg.learned_positions and cfg.positions != "learned" and cfg.d_model % 2:
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
    if cfg.position_kind == "learned":
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
def _pieces(spm_path, vocab) -> list[str]:
  """Every id's SentencePiece piece, id order; checks the model file against the Vocab."""
  import sentencepiece as spm
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
# Hugging Face.
# ----------------------------------------------------------------------------------------------------
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
  pieces = _pieces(spm_path, vocab)
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


# ----------------------------------------------------------------------------------------------------
# CTranslate2.
# ----------------------------------------------------------------------------------------------------
def ctranslate2_spec(params, cfg: TransformerConfig, vocab, pieces: list[str]):
  """Our params -> a ctranslate2 TransformerSpec with vocabularies and config filled in.

  pieces: the token string of every id (CTranslate2 takes and returns token strings).
  """
  from ctranslate2.specs import common_spec, transformer_spec
  check_exportable(cfg, "ctranslate2")
  w = neutral_weights(params, cfg)
  spec = transformer_spec.TransformerSpec.from_config(
      (cfg.num_encoder_layers, cfg.num_decoder_layers), cfg.num_heads, pre_norm=cfg.pre_norm,
      activation=common_spec.Activation.RELU)

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

  spec.config.layer_norm_epsilon = float(cfg.layer_norm_epsilon)
  spec.config.unk_token = pieces[vocab.unk_id]
  spec.config.bos_token = pieces[vocab.bos_id]
  spec.config.eos_token = pieces[vocab.eos_id]
  spec.config.decoder_start_token = pieces[vocab.bos_id]
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
                       quantization: str | None = None) -> pathlib.Path:
  """Writes a CTranslate2 model directory (model.bin, config.json, vocabularies) plus the run's
  SentencePiece model as source.spm / target.spm for tokenizing. Returns the directory.

  `ctranslate2.Translator(out_dir)` loads it; it takes SentencePiece pieces as tokens.
  """
  spec = ctranslate2_spec(params, cfg, vocab, _pieces(spm_path, vocab))
  out = save_ctranslate2(spec, out_dir, quantization)
  for name in ("source.spm", "target.spm"):
    shutil.copyfile(spm_path, out / name)
  return out


# ----------------------------------------------------------------------------------------------------
# A run directory -> an export.
# ----------------------------------------------------------------------------------------------------
def load_run(workdir, checkpoint=None, fmt: str | None = None):
  """(cfg, params, vocab, spm_path, run config, step) of a run, through the run-directory contracts.

  With `fmt`, the architecture is checked against that format before any checkpoint is read.
  """
  from data.vocab import Vocab, check_vocab
  from train.checkpoint import load_params, read_meta
  from train.config_io import load_run_config
  config = load_run_config(workdir)
  spm_path = pathlib.Path(workdir) / "vocab.model"
  if not spm_path.is_file():
    raise FileNotFoundError(f"{spm_path} not found: is {workdir!r} a run directory written by `python -m train`?")
  vocab = Vocab.load(spm_path)
  cfg = TransformerConfig(vocab_size=vocab.size, **config.model.to_dict())
  if fmt is not None:
    check_exportable(cfg, fmt)
  params, step = load_params(workdir, checkpoint)
  check_vocab(vocab, read_meta(workdir, step, checkpoint).get("vocab_fingerprint"),
              f"checkpoint {step} of {workdir}")
  return cfg, params, vocab, spm_path, config, step


def export_run(workdir, fmt: str, out_dir, checkpoint=None) -> pathlib.Path:
  """Exports run `workdir` (checkpoint None = latest, a step, or 'averaged') to `fmt` in `out_dir`."""
  if fmt not in FORMATS:
    raise ValueError(f"--format {fmt!r}: use one of {FORMATS}")
  cfg, params, vocab, spm_path, config, step = load_run(workdir, checkpoint, fmt)
  if cfg.matmul_dtype is not None and as_dtype(cfg.matmul_dtype) != as_dtype(cfg.dtype):
    print(f"note: {workdir} computes its matmuls with {cfg.matmul_dtype} operands (mixed precision); the "
          f"exported model computes them in float32 from the same float32 weights, so its logits differ "
          f"from ours by that rounding", file=sys.stderr)
  if fmt == "hf":
    beam = config.decode.get("beam_size") if "decode" in config else None
    out = export_hf(params, cfg, vocab, spm_path, out_dir, beam_size=beam)
  else:
    out = export_ctranslate2(params, cfg, vocab, spm_path, out_dir)
  (out / "aiayn_export.json").write_text(json.dumps(
      {"workdir": str(pathlib.Path(workdir).absolute()), "step": int(step), "format": fmt,
       "layer_norm_epsilon": cfg.layer_norm_epsilon}, indent=2) + "\n")
  return out


def _checkpoint_arg(text: str):
  if text in (None, "", "latest"):
    return None
  if text == "averaged":
    return "averaged"
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"--checkpoint {text!r}: use a step number, 'averaged' or 'latest'")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m decode.export", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="run directory written by `python -m train`")
  parser.add_argument("--checkpoint", type=_checkpoint_arg, default=None,
                      help="step number, 'averaged' or 'latest' (default)")
  parser.add_argument("--format", required=True, choices=FORMATS)
  parser.add_argument("--out", required=True, help="output directory (created; files are overwritten)")
  args = parser.parse_args(argv)
  try:
    out = export_run(args.workdir, args.format, args.out, args.checkpoint)
  except UnsupportedOption as error:
    parser.exit(2, f"error: {error}\n")
  print(f"wrote {args.format} export of {args.workdir} to {out}")


if __name__ == "__main__":
  main()
