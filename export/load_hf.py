"""`python -m export.load_hf --model DIR --workdir RUN`: a local Hugging Face MarianMTModel (OPUS-MT) or
PegasusForConditionalGeneration directory -> an ordinary run directory (config.json, vocab.model,
checkpoints/0) that `python -m decode` translates with, `python -m train --config
experiments/finetune.py:RUN` fine-tunes and `python -m export` writes back out.

The reverse of export/hf.py, through the same neutral weight dict (export/weights.py): Marian's d_model
axis (sines first, then cosines) is permuted into ours (interleaved), so its static sinusoids become our
positions="sinusoidal" exactly; Pegasus's stored table is read as sinusoidal where it is ours, else as
learned positions. Marian's changes to the paper's model are our switches: activation="swish", biases
everywhere (attention_bias), logits_bias=True (final_logits_bias), layer_norm_epsilon=1e-5.

The vocabulary is data.vocab.PairVocab: source.spm, target.spm and vocab.json in our id order. Ours
needs pad 0, unk 1, bos 2, eos 3; Marian's ids are </s> 0, <unk> 1, ..., <pad> last, and its decoder
starts from <pad>. The ids are reordered (every table row and logit with them): pad, unk, the decoder's
start token, eos, then the rest in Marian's order. Where the start token is pad (Marian's own models), it
takes two ids, our pad 0 and our bos 2, both with its row. OPUS-MT's generation config forbids
predicting pad (bad_words_ids); where it does, both columns' logits bias is set to FORBIDDEN_LOGIT, so
that our search, which has no such list, never picks them either.

An unsupported configuration is refused before any weight is read, with one line naming the key.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from data.vocab import BOS, PAD, VOCAB_FILE, PairVocab
from decode import DEFAULTS
from export.hf import SINUSOID_TOLERANCE
from export.interop import need
from export.weights import marian_permutation, params_from_neutral
from model import Compute, Transformer, TransformerConfig
from model.embedding import sinusoid
from run import Keep, RunDir
from run import checkpoint as ckpt
from run.user_errors import USER_ERRORS, UserError, fail
from run.workdir import write_atomically

CLASSES = {"marian": "MarianMTModel", "pegasus": "PegasusForConditionalGeneration"}
ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish"}   # Hugging Face's name -> ours
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")
# The logits bias of pad and bos where generate() may not pick pad (OPUS-MT: bad_words_ids [[pad]]; the
# converter added pad as an untrained row, whose logit would otherwise be the bias alone). Low enough
# never to win, finite so that label smoothing's sum over every logit stays small.
FORBIDDEN_LOGIT = -30.0


class UnsupportedModel(UserError):
  """A Hugging Face model that the import cannot hold exactly; the message names the key or file."""


def _refuse(key: str, value, why: str):
  raise UnsupportedModel(f"cannot import: {key}={value!r} ({why})")


# ----------------------------------------------------------------------------------------------------
# config.json -> config.model
# ----------------------------------------------------------------------------------------------------
def read_hf_config(model_dir) -> dict:
  """DIR/config.json as a dict; a missing file is refused naming it."""
  path = pathlib.Path(model_dir) / "config.json"
  if not path.is_file():
    raise UnsupportedModel(f"cannot import {model_dir}: config.json is missing (a Hugging Face model "
                           f"directory, as save_pretrained writes it)")
  return json.loads(path.read_text())


def model_settings(hf: dict) -> dict:
  """A Marian or Pegasus config.json -> our config.model keys (vocab_size excluded: it comes from the
  vocabulary, which may hold one more id). Refuses what we cannot compute exactly."""
  kind = hf.get("model_type")
  if kind not in CLASSES:
    _refuse("model_type", kind, f"the import reads {' and '.join(CLASSES)}")
  activation = hf.get("activation_function", "gelu")
  if activation not in ACTIVATIONS:
    _refuse("activation_function", activation, f"the import holds {sorted(ACTIVATIONS)}; Hugging Face's "
            f"gelu is the exact erf form, ours the tanh approximation")
  if not hf.get("scale_embedding", False):
    _refuse("scale_embedding", hf.get("scale_embedding", False), "our embeddings are scaled by sqrt(d_model)")
  for ours, (a, b) in dict(num_heads=("encoder_attention_heads", "decoder_attention_heads"),
                           d_ff=("encoder_ffn_dim", "decoder_ffn_dim")).items():
    if hf.get(a) != hf.get(b):
      _refuse(b, hf.get(b), f"{a}={hf.get(a)}: ours has one {ours} for both stacks")
  d_model, heads = int(hf["d_model"]), int(hf["encoder_attention_heads"])
  if d_model % heads:
    _refuse("encoder_attention_heads", heads, f"does not divide d_model={d_model}")
  if d_model % 2:
    _refuse("d_model", d_model, "sinusoidal positions need an even d_model")
  if kind == "marian":
    if hf.get("decoder_vocab_size") not in (None, hf["vocab_size"]):
      _refuse("decoder_vocab_size", hf["decoder_vocab_size"], f"vocab_size={hf['vocab_size']}: separate "
              f"source and target id tables; ours has one")
    if hf.get("normalize_before", False):
      _refuse("normalize_before", True, "a pre-norm Marian; Pegasus is the pre-norm class")
  shared = hf.get("share_encoder_decoder_embeddings", True) and hf.get("tie_word_embeddings", True)
  return dict(
      d_model=d_model, d_ff=int(hf["encoder_ffn_dim"]), num_heads=heads, d_k=None, d_v=None,
      num_encoder_layers=int(hf["encoder_layers"]), num_decoder_layers=int(hf["decoder_layers"]),
      dropout_rate=float(hf.get("dropout", 0.1)),
      attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
      relu_dropout_rate=float(hf.get("activation_dropout", 0.0)),
      max_len=int(hf["max_position_embeddings"]), pre_norm=kind == "pegasus", share_embeddings=bool(shared),
      attention_bias=True, layer_norm_epsilon=1e-5, activation=ACTIVATIONS[activation], logits_bias=True,
      positions="sinusoidal")


# ----------------------------------------------------------------------------------------------------
# The vocabulary: Marian's ids -> ours.
# ----------------------------------------------------------------------------------------------------
def id_order(pieces_by_id: list[str], hf: dict, unk_piece: str) -> tuple[list[int], list[str]]:
  """(order, pieces): our id i is Hugging Face id order[i], and its piece pieces[i]. Ours: pad, unk,
  the decoder's start token (as bos), eos, then the rest in their order; a start token that is pad
  gets a second id under a new piece name."""
  index = {piece: i for i, piece in enumerate(pieces_by_id)}
  if unk_piece not in index:
    _refuse("unk_token", unk_piece, "not in vocab.json")
  pad, eos, unk = int(hf["pad_token_id"]), int(hf["eos_token_id"]), index[unk_piece]
  start = pad if hf.get("decoder_start_token_id") is None else int(hf["decoder_start_token_id"])
  if len({pad, eos, unk}) < 3 or start in (eos, unk):
    _refuse("decoder_start_token_id", start, f"pad {pad}, eos {eos}, unk {unk} and the decoder's start "
            f"token must be distinct (the start token may be pad)")
  order = [pad, unk, start, eos]
  order += [i for i in range(len(pieces_by_id)) if i not in (pad, unk, start, eos)]
  pieces = [pieces_by_id[i] for i in order]
  if start == pad:   # the decoder starts from pad: bos is a second id with pad's row
    name = next(n for n in ("<s>", "<bos>", "<start>", "<s_aiayn>") if n not in index)
    pieces[2] = name
  return order, pieces


def read_vocabulary(model_dir, hf: dict) -> tuple[list[int], bytes]:
  """DIR's source.spm, target.spm and vocab.json -> (order, the PairVocab's vocab.model bytes)."""
  model_dir = pathlib.Path(model_dir)
  for name in TOKENIZER_FILES:
    if not (model_dir / name).is_file():
      raise UnsupportedModel(f"cannot import {model_dir}: {name} is missing (the import reads a "
                             f"MarianTokenizer's {', '.join(TOKENIZER_FILES)})")
  if (model_dir / "target_vocab.json").exists():
    raise UnsupportedModel(f"cannot import {model_dir}: target_vocab.json (separate source and target id "
                           f"tables); ours has one")
  ids = json.loads((model_dir / "vocab.json").read_text())
  pieces_by_id = [None] * len(ids)
  for piece, i in ids.items():
    if not 0 <= int(i) < len(ids) or pieces_by_id[int(i)] is not None:
      raise UnsupportedModel(f"cannot import {model_dir}: vocab.json's ids are not 0..{len(ids) - 1}, "
                             f"each once (piece {piece!r} has id {i})")
    pieces_by_id[int(i)] = piece
  if len(ids) != int(hf["vocab_size"]):
    _refuse("vocab_size", hf["vocab_size"], f"vocab.json names {len(ids)} pieces")
  tokenizer = model_dir / "tokenizer_config.json"
  unk = json.loads(tokenizer.read_text()).get("unk_token", "<unk>") if tokenizer.exists() else "<unk>"
  unk = unk.get("content", "<unk>") if isinstance(unk, dict) else unk
  order, pieces = id_order(pieces_by_id, hf, unk)
  bundle = PairVocab.bundle((model_dir / "source.spm").read_bytes(), (model_dir / "target.spm").read_bytes(),
                            pieces)
  return order, bundle


# ----------------------------------------------------------------------------------------------------
# The weights.
# ----------------------------------------------------------------------------------------------------
def hf_weights(model_dir) -> dict[str, np.ndarray]:
  """Every weight of DIR's model as float32 numpy, Marian's neutral names (no 'model.' prefix), as
  transformers loads them (safetensors or pytorch_model.bin, tied weights filled in)."""
  transformers = need("transformers")   # the interop extra: only for the import
  model = transformers.AutoModelForSeq2SeqLM.from_pretrained(model_dir)
  out = {}
  for name, tensor in model.state_dict().items():
    out[name.removeprefix("model.")] = tensor.detach().float().cpu().numpy()
  out["final_logits_bias"] = out["final_logits_bias"].reshape(-1)
  return out


def _positions(w: dict, settings: dict) -> str:
  """'sinusoidal' where both stored position tables are our sinusoids in Marian's layout, else
  'learned' (pre-norm only: MarianMTModel recomputes its sinusoids, so a Marian table always is)."""
  d, max_len = settings["d_model"], settings["max_len"]
  ours = np.asarray(sinusoid(jnp.arange(max_len), d), np.float32)[:, marian_permutation(d)]
  tables = [w[f"{stack}.embed_positions.weight"] for stack in ("encoder", "decoder")]
  if all(t.shape == ours.shape and np.allclose(t, ours, rtol=0.0, atol=SINUSOID_TOLERANCE) for t in tables):
    return "sinusoidal"
  if not settings["pre_norm"]:
    _refuse("embed_positions", "learned", "a post-norm Marian's positions are its fixed sinusoids")
  return "learned"


def import_weights(w: dict, settings: dict, order: list[int], forbidden_pad: bool = False
                   ) -> tuple[dict, TransformerConfig]:
  """Hugging Face weights (hf_weights) -> (our params, our TransformerConfig), ids in our order.
  forbidden_pad: the generation config forbids pad, which is also our bos (Marian's decoder start):
  both columns' logits bias is lowered to FORBIDDEN_LOGIT. Every array is checked against the shapes
  our model initialises."""
  cfg = TransformerConfig(vocab_size=len(order), **{**settings, "positions": _positions(w, settings)})
  w = dict(w)
  if cfg.share_embeddings:
    tables = [w["encoder.embed_tokens.weight"], w["decoder.embed_tokens.weight"], w["lm_head.weight"]]
    if not all(np.array_equal(tables[0], t) for t in tables[1:]):
      _refuse("tie_word_embeddings", True, "but the stored input and output tables differ")
  for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight",
               "final_logits_bias"):
    w[name] = w[name][order]   # rows in our id order
  if forbidden_pad:   # generate() never picks pad (bad_words_ids); nor does our search then
    w["final_logits_bias"][[PAD, BOS]] = np.minimum(w["final_logits_bias"][[PAD, BOS]], FORBIDDEN_LOGIT)
  params = params_from_neutral(w, cfg)
  expected = jax.eval_shape(lambda: Transformer(cfg).init(
      jax.random.key(0), jnp.ones((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32))["params"])
  if jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(params):
    raise RuntimeError(f"export/load_hf.py: the imported tree is not the model's: "
                       f"{jax.tree_util.tree_structure(params)} vs {jax.tree_util.tree_structure(expected)}")
  for (path, ours), theirs in zip(jax.tree_util.tree_leaves_with_path(params),
                                  jax.tree_util.tree_leaves(expected)):
    if ours.shape != theirs.shape:
      raise RuntimeError(f"export/load_hf.py: {jax.tree_util.keystr(path)} is {ours.shape}, the model's "
                         f"{theirs.shape}")
  return params, cfg


# ----------------------------------------------------------------------------------------------------
# The run directory.
# ----------------------------------------------------------------------------------------------------
def run_config(settings: dict, cfg: TransformerConfig, hf: dict, source_eos: bool = True
               ) -> ml_collections.ConfigDict:
  """The run's config.json: the imported model, sources ending in eos (MarianTokenizer appends </s>;
  a directory we exported says in aiayn_export.json whether its run did), max_len the model's, decoding
  with the generation config's beam. The data and train sections say only what decoding reads;
  experiments/finetune.py makes a fine-tuning run's whole config from them."""
  model = dict(settings, positions=cfg.positions)
  decoding = dict(DEFAULTS)
  if hf.get("num_beams"):
    decoding["beam_size"] = int(hf["num_beams"])
  return ml_collections.ConfigDict(dict(
      seed=0, workdir="", model=model, compute=dataclasses.asdict(Compute()), decode=decoding,
      data=dict(source="files", source_eos=bool(source_eos), max_len=cfg.max_len, vocab_size=cfg.vocab_size),
      train=dict(num_steps=0, imported_from=CLASSES[hf["model_type"]])))


def pad_is_forbidden(model_dir, hf: dict) -> bool:
  """Whether DIR's generation config (or config.json, in older directories) has bad_words_ids [[pad]]."""
  path = pathlib.Path(model_dir) / "generation_config.json"
  generation = json.loads(path.read_text()) if path.exists() else {}
  banned = generation.get("bad_words_ids") or hf.get("bad_words_ids") or []
  return [int(hf["pad_token_id"])] in banned


def import_hf(model_dir, workdir) -> pathlib.Path:
  """Writes run directory `workdir` (new, or empty) from Hugging Face model directory `model_dir`.
  Returns the workdir."""
  model_dir, workdir = pathlib.Path(model_dir), pathlib.Path(workdir)
  if not model_dir.is_dir():
    raise UserError(f"--model {model_dir} is not a directory: give a Hugging Face model directory")
  if workdir.exists() and any(workdir.iterdir()):
    raise UserError(f"--workdir {workdir} is not empty: give a new run directory")
  hf = read_hf_config(model_dir)
  settings = model_settings(hf)
  order, vocab_bytes = read_vocabulary(model_dir, hf)
  params, cfg = import_weights(hf_weights(model_dir), settings, order,
                               forbidden_pad=order[BOS] == order[PAD] and pad_is_forbidden(model_dir, hf))
  ours = model_dir / "aiayn_export.json"   # written by python -m export
  source_eos = json.loads(ours.read_text()).get("source_eos", True) if ours.exists() else True
  # The run directory, opened once: it writes step 0 of RUN/checkpoints.
  with RunDir(workdir, write={ckpt.CHECKPOINTS: Keep(async_save=False)}).create() as run:
    vocab = PairVocab(vocab_bytes, run.path / VOCAB_FILE)
    write_atomically(run.path / VOCAB_FILE, vocab_bytes)
    run.save_config(run_config(settings, cfg, hf, source_eos))
    run.write_versions()
    ckpt.save(run.checkpoints(), 0, params, None, {"step": 0, "vocab_fingerprint": vocab.fingerprint,
                                                   "imported_from": str(model_dir.absolute()),
                                                   "hf_class": CLASSES[hf["model_type"]]})
  return workdir


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m export.load_hf", description=__doc__.split("\n")[0])
  parser.add_argument("--model", required=True, help="a local Hugging Face model directory")
  parser.add_argument("--workdir", required=True, help="the run directory to write (new or empty)")
  args = parser.parse_args(argv)
  try:
    out = import_hf(args.model, args.workdir)
  except USER_ERRORS as error:   # one line `error: ...`, exit status 2
    fail(error)
  print(f"imported {args.model} into {out}")


if __name__ == "__main__":
  main()
