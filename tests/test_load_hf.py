"""Import from Hugging Face (export/load_hf.py): a MarianMTModel or Pegasus model built here with random
weights, two SentencePiece models trained on the fly and a joint vocab.json, saved with save_pretrained
(no download), then imported into a run directory and held to Hugging Face's own computation: the
logits, greedy search through `python -m decode`, beam search, the tokenizer; refusals name the key.
"""
import json
import os
import pathlib
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

from data.vocab import BOS, EOS, PAD, PairVocab
from decode.translate import translate
from export import load_hf
from export.load_hf import UnsupportedModel
from model.config import TransformerConfig
import run
from train.flops import num_params

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORDS = ("the a cat dog sat on mat house tree runs quickly slowly red blue green big small over under "
         "bird fish eats sleeps near far river hill").split()
N_SENTENCES = 100


def source_sentences(seed, n, lo=2, hi=9):
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def target_of(sentence):
  """A made-up target language: every word reversed and capitalised (its own SentencePiece model)."""
  return " ".join(w[::-1].capitalize() for w in sentence.split())


def _spm(texts, size):
  import io
  writer = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=writer, vocab_size=size,
                                 model_type="unigram", hard_vocab_limit=False, minloglevel=2,
                                 character_coverage=1.0)
  return writer.getvalue()


def write_tokenizer(out: pathlib.Path):
  """source.spm, target.spm and a joint vocab.json in Marian's layout: </s> 0, <unk> 1, the pieces of
  both models, <pad> last. Returns the number of ids."""
  sources = source_sentences(1, 400)
  models = {"source": _spm(sources, 60), "target": _spm([target_of(s) for s in sources], 70)}
  pieces = ["</s>", "<unk>"]
  for side, data in models.items():
    (out / f"{side}.spm").write_bytes(data)
    processor = spm.SentencePieceProcessor(model_proto=data)
    for i in range(processor.get_piece_size()):
      piece = processor.id_to_piece(i)
      if not processor.is_control(i) and not processor.is_unknown(i) and piece not in pieces:
        pieces.append(piece)
  pieces.append("<pad>")
  (out / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
  transformers.MarianTokenizer(source_spm=str(out / "source.spm"), target_spm=str(out / "target.spm"),
                               vocab=str(out / "vocab.json")).save_pretrained(out)
  return len(pieces)


def build_hf(out: pathlib.Path, kind="marian", tied=True, seed=0, eos_bias=3.0, pad_bias=-100.0, **overrides):
  """A random-weight Hugging Face model directory (model + tokenizer). LayerNorms and biases are
  perturbed (init leaves them 1 and 0); the logits bias is random, pad's far below (OPUS-MT never
  predicts pad) and eos's raised so that translations end."""
  out.mkdir(parents=True, exist_ok=True)
  vocab_size = write_tokenizer(out)
  pad = vocab_size - 1
  common = dict(vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=48,
                decoder_ffn_dim=48, encoder_attention_heads=4, decoder_attention_heads=4,
                max_position_embeddings=64, activation_function="swish", scale_embedding=True,
                dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, init_std=0.15,
                pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=None,
                tie_word_embeddings=tied)
  if kind == "marian":
    config = transformers.MarianConfig(decoder_vocab_size=vocab_size, share_encoder_decoder_embeddings=tied,
                                       **{**common, **overrides})
    model_class = transformers.MarianMTModel
  else:
    config = transformers.PegasusConfig(**{**common, **overrides})
    model_class = transformers.PegasusForConditionalGeneration
  torch.manual_seed(seed)
  model = model_class(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "layer_norm" in name or name.endswith(".bias"):
        p.add_(0.1 * torch.randn_like(p))
    bias = 0.5 * torch.randn(1, vocab_size)
    bias[0, pad], bias[0, 0] = pad_bias, eos_bias
    model.final_logits_bias.copy_(bias)
  model.generation_config.bad_words_ids = [[pad]]
  model.save_pretrained(out)
  return out


@pytest.fixture(scope="module", params=["tied", "untied"])
def imported(request, tmp_path_factory):
  root = tmp_path_factory.mktemp(f"marian_{request.param}")
  hf_dir = build_hf(root / "hf", tied=request.param == "tied")
  workdir = load_hf.import_hf(hf_dir, root / "run")
  return hf_dir, workdir


def _hf(hf_dir):
  model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
  return model, transformers.MarianTokenizer.from_pretrained(hf_dir)


def _our_order(hf_dir, vocab):
  hf_ids = json.loads((hf_dir / "vocab.json").read_text())
  config = json.loads((hf_dir / "config.json").read_text())
  return np.asarray([hf_ids.get(p, config["decoder_start_token_id"]) for p in vocab.pieces])


def _logits_match(hf_dir, workdir, sentences):
  opened = run.load_run(workdir)
  model, tokenizer = _hf(hf_dir)
  order = _our_order(hf_dir, opened.vocab)
  targets = [target_of(s) for s in sentences]
  batch = tokenizer(sentences, text_target=targets, return_tensors="pt", padding=True)
  labels = batch["labels"]
  start = torch.full((labels.shape[0], 1), model.config.decoder_start_token_id)
  decoder_in = torch.cat([start, labels[:, :-1]], dim=1)
  decoder_in[decoder_in == -100] = model.config.pad_token_id
  with torch.no_grad():
    theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=decoder_in).logits.numpy()           # [b, tgt_len, hf vocab]
  vocab = opened.vocab
  src = [vocab.encode(s) + [EOS] for s in sentences]
  tgt = [vocab.encode(t, "target") + [EOS] for t in targets]
  # The tokenizers agree id for id.
  for i in range(len(sentences)):
    n = int(batch["attention_mask"][i].sum())
    assert order[src[i]].tolist() == batch["input_ids"][i, :n].tolist()
    assert order[tgt[i]].tolist() == [t for t in labels[i].tolist() if t != -100 and t != model.config.pad_token_id]
  width_s, width_t = max(map(len, src)), max(map(len, tgt))
  src_ids = np.asarray([s + [PAD] * (width_s - len(s)) for s in src], np.int32)
  tgt_in = np.asarray([[BOS] + t[:-1] + [PAD] * (width_t - len(t)) for t in tgt], np.int32)
  ours = np.asarray(opened.model.apply({"params": opened.params}, jnp.asarray(src_ids), jnp.asarray(tgt_in)))
  real = tgt_in != PAD
  real[:, 0] = True
  diff = np.abs(ours[..., :] - theirs[..., order])[real]
  return float(diff.max()), float(np.abs(theirs).max())


def test_logits_equal_hugging_faces_on_100_sentences(imported):
  hf_dir, workdir = imported
  worst, scale = _logits_match(hf_dir, workdir, source_sentences(7, N_SENTENCES))
  assert scale > 1.0            # not a degenerate model
  assert worst < 1e-4, worst


MAX_EXTRA_LEN = 8


def _hf_generate(hf_dir, sentences, num_beams, length_penalty=1.0):
  """HF generate with our length limit (a random model need not stop), one batch per source length: our
  search allows source length (with its </s>) + MAX_EXTRA_LEN tokens counting the final eos, so at
  most one fewer word; the text is the same whether or not the last slot holds that eos."""
  model, tokenizer = _hf(hf_dir)
  lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
  out = [None] * len(sentences)
  for length in sorted(set(lengths)):
    members = [i for i, n in enumerate(lengths) if n == length]
    batch = tokenizer([sentences[i] for i in members], return_tensors="pt", padding=True)
    with torch.no_grad():
      ids = model.generate(**batch, num_beams=num_beams, max_new_tokens=length + MAX_EXTRA_LEN - 1,
                           do_sample=False, length_penalty=length_penalty, early_stopping=True)
    for i, text in zip(members, tokenizer.batch_decode(ids, skip_special_tokens=True)):
      out[i] = text
  return out


@pytest.mark.slow   # a decode process: 15-30 s on two shared cores
def test_greedy_through_python_m_decode_equals_hf_generate(imported, tmp_path):
  hf_dir, workdir = imported
  sentences = source_sentences(8, N_SENTENCES)
  (tmp_path / "src.txt").write_text("\n".join(sentences) + "\n")
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  subprocess.run([sys.executable, "-m", "decode", "--workdir", str(workdir), "--input", str(tmp_path / "src.txt"),
                  "--output", str(tmp_path / "hyp.txt"), "--beam_size", "1", "--cpu_devices", "1",
                  "--max_extra_len", str(MAX_EXTRA_LEN)], check=True, env=env, cwd=ROOT, capture_output=True)
  ours = (tmp_path / "hyp.txt").read_text().split("\n")[:len(sentences)]
  theirs = _hf_generate(hf_dir, sentences, 1)
  assert len(set(theirs)) > 10   # translations that differ (a random model repeats itself), not one string
  assert ours == theirs


def test_beam_4_agrees_with_hf_generate(imported):
  """Our beam search divides a finished hypothesis's log-probability by GNMT's ((5 + length) / 6)^alpha,
  Hugging Face's by length^length_penalty; with alpha=0 and length_penalty=0 both rank by the plain
  sum, which leaves the search's other details (when a beam stops) as the only differences."""
  hf_dir, workdir = imported
  opened = run.load_run(workdir)
  sentences = source_sentences(9, N_SENTENCES)
  ours = translate(opened.model, opened.params, opened.vocab, sentences, beam_size=4, alpha=0.0,
                   max_extra_len=MAX_EXTRA_LEN, source_eos=True)
  theirs = _hf_generate(hf_dir, sentences, 4, length_penalty=0.0)
  agree = np.mean([a == b for a, b in zip(ours, theirs)])
  print(f"beam 4: {agree:.0%} of {len(sentences)} sentences agree")
  assert agree >= 0.95


def test_pair_vocab_round_trips_through_its_bundle(imported):
  hf_dir, workdir = imported
  vocab = run.load_vocab(workdir)
  assert isinstance(vocab, PairVocab)
  again = PairVocab(PairVocab.bundle(vocab.spm_bytes["source"], vocab.spm_bytes["target"], vocab.pieces))
  assert again.fingerprint == vocab.fingerprint
  assert (vocab.id_to_piece(PAD), vocab.id_to_piece(EOS)) == ("<pad>", "</s>")
  text = target_of("the big dog sleeps near the river")
  assert vocab.decode(vocab.encode(text, "target") + [EOS, 5, 6]) == text
  # The two sides cut differently: the source model has never seen the target's words.
  assert vocab.encode(text, "source") != vocab.encode(text, "target")
  # Batching (dev and test sets) and the token cache cut targets with target.spm.
  from data.batching import tokenize
  src, tgt, _ = tokenize(vocab, [("the big dog", text)], source_eos=True)
  assert src[0].tolist() == vocab.encode("the big dog") + [EOS] and tgt[0].tolist() == vocab.encode(text, "target")


# ---------------------------------------------------------------------------------------------------
def test_pegasus_logits_equal_hugging_faces(tmp_path):
  hf_dir = build_hf(tmp_path / "hf", kind="pegasus", activation_function="relu")
  workdir = load_hf.import_hf(hf_dir, tmp_path / "run")
  cfg = run.load_run(workdir).model_config
  assert cfg.pre_norm and cfg.positions == "sinusoidal" and cfg.activation == "relu"
  worst, _ = _logits_match(hf_dir, workdir, source_sentences(7, 20))
  assert worst < 1e-4, worst


def test_transformer_big_config_maps_to_our_big_model():
  """OPUS-MT's big models' dimensions: the config path alone (the model is built on the meta device)."""
  config = transformers.MarianConfig(vocab_size=58101, decoder_vocab_size=58101, d_model=1024,
                                     encoder_layers=6, decoder_layers=6, encoder_ffn_dim=4096,
                                     decoder_ffn_dim=4096, encoder_attention_heads=16,
                                     decoder_attention_heads=16, max_position_embeddings=512,
                                     activation_function="swish", scale_embedding=True,
                                     pad_token_id=58100, eos_token_id=0, decoder_start_token_id=58100)
  settings = load_hf.model_settings(config.to_dict())
  cfg = TransformerConfig(vocab_size=58101, **settings)
  big = TransformerConfig(vocab_size=58101, d_model=1024, d_ff=4096, num_heads=16)
  assert (cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.num_encoder_layers) == (big.d_model, big.d_ff,
                                                                          big.num_heads, 6)
  with torch.device("meta"):
    model = transformers.MarianMTModel(config)
  # Theirs: one table (tied), the logits bias a buffer, the positions fixed; the same count as ours.
  theirs = sum(p.numel() for name, p in model.named_parameters() if "embed_positions" not in name)
  theirs += model.final_logits_bias.numel()
  assert num_params(cfg) == theirs


@pytest.mark.parametrize("key,value,named", [
    ("activation_function", "gelu", "activation_function='gelu'"),
    ("scale_embedding", False, "scale_embedding=False"),
    ("decoder_vocab_size", 99, "decoder_vocab_size=99"),
    ("model_type", "bart", "model_type='bart'"),
    ("encoder_ffn_dim", 64, "decoder_ffn_dim=48"),
])
def test_an_unsupported_config_is_refused_naming_the_key(key, value, named):
  config = transformers.MarianConfig(vocab_size=100, decoder_vocab_size=100, d_model=32, encoder_ffn_dim=48,
                                     decoder_ffn_dim=48, activation_function="swish",
                                     scale_embedding=True).to_dict()
  config[key] = value
  with pytest.raises(UnsupportedModel, match=f"{named}"):
    load_hf.model_settings(config)


def test_the_command_line_refuses_a_missing_tokenizer_file_in_one_line(tmp_path):
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(json.dumps(transformers.MarianConfig(
      vocab_size=10, decoder_vocab_size=10, d_model=32, activation_function="swish", scale_embedding=True,
      pad_token_id=9, eos_token_id=0, decoder_start_token_id=9).to_dict()))
  (hf_dir / "vocab.json").write_text("{}")
  result = subprocess.run([sys.executable, "-m", "export.load_hf", "--model", str(hf_dir), "--workdir",
                           str(tmp_path / "run")], env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                          capture_output=True, text=True)
  assert result.returncode == 2
  assert result.stderr.strip().count("\n") == 0 and "source.spm is missing" in result.stderr


# ---------------------------------------------------------------------------------------------------
def _write_corpus(path, seed, n):
  sentences = source_sentences(seed, n)
  path.write_text("".join(f"{s}\t{target_of(s)}\n" for s in sentences))
  return str(path)


@pytest.mark.slow   # trains 50 steps and exports: about a minute on two shared cores
def test_import_fine_tune_50_steps_export_round_trip(tmp_path):
  """Import, fine-tune 50 steps with experiments/finetune.py, export to HF: the export holds our
  weights and translates as our decode does; the fine-tuned parameters moved from the imported ones."""
  from experiments import apply_overrides, load_experiment
  import export
  from train.train import train_and_evaluate
  hf_dir = build_hf(tmp_path / "hf", tied=False, eos_bias=0.0)
  pretrained = load_hf.import_hf(hf_dir, tmp_path / "pretrained")
  config = load_experiment(f"{ROOT / 'experiments' / 'finetune.py'}:{pretrained}")
  apply_overrides(config, {
      "data.train_path": _write_corpus(tmp_path / "train.tsv", 11, 300),
      "data.dev_path": _write_corpus(tmp_path / "dev.tsv", 12, 20),
      "data.test_path": _write_corpus(tmp_path / "test.tsv", 13, 20),
      "train.num_steps": 50, "train.warmup_steps": 5, "train.learning_rate": 1e-3, "train.eval_every": 25,
      "train.checkpoint_every_steps": 50, "train.test_bleu": False, "train.progress": False,
      "train.tensorboard": False, "data.batch_tokens": 512, "data.max_len": 32})
  outcome = train_and_evaluate(config, tmp_path / "ft")
  assert outcome.step == 50
  before, after = run.load_run(pretrained), run.load_run(tmp_path / "ft")
  assert after.vocab.fingerprint == before.vocab.fingerprint
  moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
           zip(jax.tree_util.tree_leaves(after.params), jax.tree_util.tree_leaves(before.params))]
  assert min(moved) > 0.0

  out = export.export_run(tmp_path / "ft", "hf", tmp_path / "exported")
  exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
  from export.hf import hf_state
  ours = hf_state(after.params, after.model_config)
  theirs = exported.state_dict()
  for name, tensor in ours.items():
    if name in theirs and "embed_positions" not in name:
      assert torch.equal(theirs[name], tensor), name
  sentences = source_sentences(14, 30)
  tokenizer = transformers.MarianTokenizer.from_pretrained(out)
  batch = tokenizer(sentences, return_tensors="pt", padding=True)
  with torch.no_grad():
    ids = exported.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=60)
  hf_text = tokenizer.batch_decode(ids, skip_special_tokens=True)
  our_text = translate(after.model, after.params, after.vocab, sentences, beam_size=1, max_extra_len=50,
                       source_eos=True)
  agree = np.mean([a == b for a, b in zip(our_text, hf_text)])
  print(f"round trip: {agree:.0%} of {len(sentences)} greedy translations agree; e.g. {our_text[0]!r}")
  assert sum(len(t) > 0 for t in hf_text) > 20
  assert agree == 1.0, (our_text[:3], hf_text[:3])


def test_an_export_of_an_import_imports_to_the_same_run(imported, tmp_path):
  """import -> python -m export -> import: the same parameters bit for bit and the same vocabulary
  (our export writes our ids, bos the decoder's start, so the second import keeps them)."""
  import export
  _, workdir = imported
  out = export.export_run(workdir, "hf", tmp_path / "exported")
  again = load_hf.import_hf(out, tmp_path / "again")
  first, second = run.load_run(workdir), run.load_run(again)
  assert second.vocab.fingerprint == first.vocab.fingerprint
  assert second.model_config == first.model_config
  for a, b in zip(jax.tree_util.tree_leaves(first.params), jax.tree_util.tree_leaves(second.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow   # imports and searches a third model
def test_a_pad_that_generate_may_not_pick_our_search_does_not_pick(tmp_path, monkeypatch):
  """OPUS-MT's converter adds pad as an untrained row with bias 0 and forbids it in generate()
  (bad_words_ids); the import lowers our pad's and bos's logits bias so that our search, which has no
  such list, agrees with generate(). The import opens the run's checkpoints once."""
  from test_run_dir import count_managers
  hf_dir = build_hf(tmp_path / "hf", pad_bias=0.0)
  with torch.no_grad():   # the pad row as the converter leaves it: zeros, so its logit is its bias
    model = transformers.MarianMTModel.from_pretrained(hf_dir)
    model.get_input_embeddings().weight[model.config.pad_token_id] = 0.0
    model.save_pretrained(hf_dir)
  managers = count_managers(monkeypatch)
  workdir = load_hf.import_hf(hf_dir, tmp_path / "run")
  assert managers == {tmp_path / "run" / "checkpoints": 1}
  opened = run.load_run(workdir)
  bias = np.asarray(opened.params["final_logits_bias"])
  assert bias[PAD] == bias[BOS] == load_hf.FORBIDDEN_LOGIT
  sentences = source_sentences(15, 40)
  ours = translate(opened.model, opened.params, opened.vocab, sentences, beam_size=1,
                   max_extra_len=MAX_EXTRA_LEN, source_eos=True)
  assert ours == _hf_generate(hf_dir, sentences, 1)


def test_an_imported_model_exports_to_ctranslate2_and_translates_as_ours(imported, tmp_path):
  """swish and the logits bias in CTranslate2's spec; sources cut by source.spm, outputs joined by
  target.spm: greedy translations equal ours."""
  ctranslate2 = pytest.importorskip("ctranslate2")
  import export
  _, workdir = imported
  out = export.export_run(workdir, "ctranslate2", tmp_path / "ct2")
  opened = run.load_run(workdir)
  sentences = source_sentences(16, 40)
  source = spm.SentencePieceProcessor(model_file=str(out / "source.spm"))
  translator = ctranslate2.Translator(str(out), device="cpu")
  ids = {piece: i for i, piece in enumerate(opened.vocab.pieces)}
  theirs = []
  for pieces in source.encode(sentences, out_type=str):   # our length limit (see _hf_generate)
    result = translator.translate_batch([pieces], beam_size=1, min_decoding_length=0,
                                        max_decoding_length=len(pieces) + 1 + MAX_EXTRA_LEN - 1)
    theirs.append(opened.vocab.decode([ids[p] for p in result[0].hypotheses[0]]))
  ours = translate(opened.model, opened.params, opened.vocab, sentences, beam_size=1,
                   max_extra_len=MAX_EXTRA_LEN, source_eos=True)
  assert len(set(ours)) > 5
  assert ours == theirs


def test_marians_own_sinusoids_at_opus_mt_size_import_as_ours():
  """OPUS-MT's 512 positions of d_model 512, as MarianMTModel computes them (float64 angles), are our
  float32 sinusoids within SINUSOID_TOLERANCE: a post-norm Marian imports with positions='sinusoidal'."""
  config = transformers.MarianConfig(vocab_size=16, decoder_vocab_size=16, d_model=512, encoder_layers=1,
                                     decoder_layers=1, encoder_ffn_dim=8, decoder_ffn_dim=8,
                                     max_position_embeddings=512, activation_function="swish",
                                     scale_embedding=True, pad_token_id=15, eos_token_id=0,
                                     decoder_start_token_id=15)
  model = transformers.MarianMTModel(config)
  weights = {name.removeprefix("model."): t.detach().numpy() for name, t in model.state_dict().items()}
  settings = load_hf.model_settings(config.to_dict())
  assert load_hf._positions(weights, settings) == "sinusoidal"
  weights["decoder.embed_positions.weight"] = weights["decoder.embed_positions.weight"] + 1e-3
  with pytest.raises(UnsupportedModel, match="embed_positions"):
    load_hf._positions(weights, settings)
