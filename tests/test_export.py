"""Export to Hugging Face (MarianMTModel) and CTranslate2: the exported models compute what ours does.

One tiny run directory (config.json, vocab.model, an Orbax checkpoint of random weights) goes through
`python -m export`'s main for both formats; the exports are then loaded by transformers and
ctranslate2 as a user would, and compared with our model on the same ids.
"""
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The interop extra (pip install -e '.[interop]'; CI installs it): without it only this file is skipped.
ctranslate2 = pytest.importorskip("ctranslate2")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from data.vocab import Vocab, train_vocab
import export
from export import __main__ as export_cli
from export import ct2 as ct2_export
from export import hf as hf_export
from experiments.default import get_config
from model import Transformer, TransformerConfig
from run import checkpoint as ckpt
from run.config import save_config

WORDS = ("the a cat dog sat on mat house tree runs quickly slowly red blue green big small over under "
         "bird fish eats sleeps near far river hill").split()
MAX_NEW = 12


def sentences(rng, n, lo=2, hi=12):
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def perturbed_init(cfg, seed=0):
  """Random weights with non-trivial LayerNorm scales/offsets and biases (init leaves them 1 and 0)."""
  ids = jnp.ones((1, 3), jnp.int32)
  params = Transformer(cfg).init({"params": jax.random.key(seed)}, ids, ids)["params"]
  key = jax.random.key(seed + 1)

  def perturb(path, x):
    if jax.tree_util.keystr(path).endswith(("['bias']", "['scale']")):
      return x + 0.1 * jax.random.normal(jax.random.fold_in(key, x.size + len(str(path))), x.shape)
    return x
  return jax.tree_util.tree_map_with_path(perturb, params)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run directory with the default experiment's layout, a 2+2-layer model and a 60-piece vocabulary."""
  workdir = tmp_path_factory.mktemp("run")
  rng = random.Random(0)
  model_bytes = train_vocab(sentences(rng, 400), 60, seed=0, sample_sentences=400, model_type="unigram")
  (workdir / "vocab.model").write_bytes(model_bytes)
  vocab = Vocab.load(workdir / "vocab.model")
  config = get_config("smoke")
  config.model.update(d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2, num_decoder_layers=2)
  save_config(config, workdir)
  cfg = TransformerConfig(vocab_size=vocab.size, **config.model.to_dict())
  params = perturbed_init(cfg)
  manager = ckpt.make_manager(workdir)
  ckpt.save(manager, 7, params, None, {"step": 7})
  manager.wait_until_finished()
  manager.close()
  hf_dir, ct2_dir = workdir / "export_hf", workdir / "export_ct2"
  export_cli.main(["--workdir", str(workdir), "--format", "hf", "--out", str(hf_dir)])
  export_cli.main(["--workdir", str(workdir), "--checkpoint", "7", "--format", "ctranslate2",
               "--out", str(ct2_dir)])
  return dict(workdir=workdir, vocab=vocab, cfg=cfg, params=params, hf_dir=hf_dir, ct2_dir=ct2_dir,
              texts=sentences(random.Random(1), 6))


def padded(rows):
  out = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


def our_greedy(cfg, params, src, max_new):
  """Greedy search through the cached decode_step: ids [b, <= max_new] without bos, eos kept, 0 after."""
  from model import init_cache
  model = Transformer(cfg)
  src = jnp.asarray(src)
  enc_out = model.apply({"params": params}, src, method="encode")
  cross = model.apply({"params": params}, enc_out, method="prepare_decoding")
  cache = init_cache(cfg, batch_size=src.shape[0], max_len=max_new)
  ids = jnp.full((src.shape[0],), 2, jnp.int32)
  done = np.zeros(src.shape[0], bool)
  out = []
  for _ in range(max_new):
    logits, cache = model.apply({"params": params}, ids, cache, cross, src != 0, method="decode_step")
    ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out.append(np.where(done, 0, np.asarray(ids)))
    done |= np.asarray(ids) == 3
  return np.stack(out, axis=1)


def trim(row):
  """Generated ids up to and including the first eos."""
  row = [int(i) for i in row]
  return row[:row.index(3) + 1] if 3 in row else row


def test_hf_directory_loads_and_its_logits_equal_ours(run):
  from transformers import MarianMTModel, MarianTokenizer
  model = MarianMTModel.from_pretrained(run["hf_dir"]).eval()
  tokenizer = MarianTokenizer.from_pretrained(run["hf_dir"])
  vocab, texts = run["vocab"], run["texts"]
  # Our sources carry no eos: the tokenizer must be called with add_special_tokens=False.
  batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
  src = padded([vocab.encode(t) for t in texts])
  np.testing.assert_array_equal(batch["input_ids"].numpy(), src)
  assert model.config.decoder_start_token_id == vocab.bos_id and model.config.pad_token_id == 0
  tgt = padded([[vocab.bos_id] + vocab.encode(t) for t in sentences(random.Random(2), len(texts))])
  ours = np.asarray(Transformer(run["cfg"]).apply({"params": run["params"]}, src, tgt))
  with torch.no_grad():
    theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=torch.from_numpy(tgt).long()).logits.numpy()
  real = tgt != 0
  assert real.sum() > real.shape[0] * 3 and len({int(r.sum()) for r in real}) > 2
  # The only inexact part: Marian's LayerNorm epsilon is 1e-5, ours 1e-6.
  assert np.abs(ours - theirs)[real].max() <= 1e-4


def test_exact_with_matching_epsilon_and_unshared_biasfree_variant(run):
  """Marian (post-norm) and Pegasus (pre-norm: learned positions, separate tables, no attention bias)."""
  vocab = run["vocab"]
  for switches in (dict(layer_norm_epsilon=1e-5), dict(share_embeddings=False, attention_bias=False),
                   dict(pre_norm=True, layer_norm_epsilon=1e-5),
                   dict(pre_norm=True, positions="learned", share_embeddings=False, attention_bias=False)):
    cfg = TransformerConfig(vocab_size=vocab.size, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
                            num_decoder_layers=2, **switches)
    params = perturbed_init(cfg, seed=3)
    rng = np.random.default_rng(0)
    src = rng.integers(4, vocab.size, (3, 7)).astype(np.int32)
    src[1, 4:] = 0
    tgt = rng.integers(4, vocab.size, (3, 5)).astype(np.int32)
    tgt[:, 0] = 2
    ours = np.asarray(Transformer(cfg).apply({"params": params}, src, tgt))
    with torch.no_grad():
      theirs = hf_export.to_hf(params, cfg, vocab)(
          input_ids=torch.from_numpy(src).long(), attention_mask=torch.from_numpy(src != 0),
          decoder_input_ids=torch.from_numpy(tgt).long()).logits.numpy()
    tol = 2e-6 if "layer_norm_epsilon" in switches else 1e-4
    assert np.abs(ours - theirs).max() <= tol, switches


def test_greedy_is_identical_in_ours_hf_and_ctranslate2(run):
  from transformers import MarianMTModel
  vocab, texts = run["vocab"], run["texts"]
  src = padded([vocab.encode(t) for t in texts])
  ours = [trim(r) for r in our_greedy(run["cfg"], run["params"], src, MAX_NEW)]
  model = MarianMTModel.from_pretrained(run["hf_dir"]).eval()
  with torch.no_grad():
    hf = model.generate(input_ids=torch.from_numpy(src).long(), attention_mask=torch.from_numpy(src != 0),
                        num_beams=1, do_sample=False, max_new_tokens=MAX_NEW).numpy()
  assert (hf[:, 0] == vocab.bos_id).all()
  hf = [trim(r[1:]) for r in hf]
  translator = ctranslate2.Translator(str(run["ct2_dir"]), device="cpu", intra_threads=2)
  pieces = json.loads((run["hf_dir"] / "vocab.json").read_text())
  id_of = {p: i for p, i in pieces.items()}
  results = translator.translate_batch([[vocab.id_to_piece(int(i)) for i in r if i] for r in src],
                                       beam_size=1, max_decoding_length=MAX_NEW, return_end_token=True)
  ct2 = [[id_of[p] for p in r.hypotheses[0]] for r in results]
  assert len({tuple(r) for r in ours}) > 1 and max(len(r) for r in ours) > 3, ours   # not degenerate
  assert ours == hf, (ours, hf)
  assert ours == ct2, (ours, ct2)


def test_ctranslate2_scores_equal_ours_for_every_switch(run, tmp_path):
  """Pre-norm, learned positions, unshared embeddings, bias-free attention: CTranslate2 takes them all."""
  vocab = run["vocab"]
  cfg = run["cfg"].replace(pre_norm=True, positions="learned", share_embeddings=False,
                           attention_bias=False)
  params = perturbed_init(cfg, seed=5)
  out = ct2_export.export_ctranslate2(params, cfg, vocab, run["workdir"] / "vocab.model", tmp_path / "ct2")
  texts = run["texts"]
  src = padded([vocab.encode(t) for t in texts])
  targets = [vocab.encode(t) for t in sentences(random.Random(3), len(texts))]
  tgt_in = padded([[vocab.bos_id] + t for t in targets])
  log_probs = np.asarray(jax.nn.log_softmax(Transformer(cfg).apply({"params": params}, src, tgt_in)))
  piece = vocab.id_to_piece
  scored = ctranslate2.Translator(str(out), device="cpu").score_batch(
      [[piece(int(i)) for i in r if i] for r in src], [[piece(i) for i in t] for t in targets])
  for row, (t, s) in enumerate(zip(targets, scored)):
    expected = [log_probs[row, pos, tok] for pos, tok in enumerate(t + [vocab.eos_id])]
    assert np.abs(np.asarray(s.log_probs) - expected).max() <= 1e-4


def test_unsupported_options_are_refused_by_name(run, tmp_path):
  cfg = run["cfg"]
  with pytest.raises(export.UnsupportedOption, match="d_k"):
    export.check_exportable(cfg.replace(d_k=4), "hf")
  with pytest.raises(export.UnsupportedOption, match="d_k=4 != d_v=8"):
    export.check_exportable(cfg.replace(d_k=4), "ctranslate2")
  with pytest.raises(export.UnsupportedOption, match="activation"):
    export.check_exportable(cfg.replace(activation="gelu"), "hf")
  with pytest.raises(export.UnsupportedOption, match="learned positions with post-norm"):
    export.check_exportable(cfg.replace(positions="learned"), "hf")
  for fmt in export.FORMATS:   # pre-norm (Pegasus on Hugging Face) with learned positions goes to both
    export.check_exportable(cfg.replace(pre_norm=True, positions="learned"), fmt)
  # The command line names the option and exits non-zero.
  config = json.loads((run["workdir"] / "config.json").read_text())
  config["model"]["d_k"] = 4
  (tmp_path / "config.json").write_text(json.dumps(config))
  (tmp_path / "vocab.model").write_bytes((run["workdir"] / "vocab.model").read_bytes())
  with pytest.raises(SystemExit) as exit_info:
    export_cli.main(["--workdir", str(tmp_path), "--format", "hf", "--out", str(tmp_path / "out")])
  assert exit_info.value.code == 2
