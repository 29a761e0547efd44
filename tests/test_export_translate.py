"""Exports translate as `python -m decode` does, called the way each library documents.

A tiny run is trained for a few hundred steps on a word-for-word toy language (held-out test sentences),
exported with `python -m export`, and translated three ways: `python -m decode`, Hugging Face
(AutoTokenizer + AutoModelForSeq2SeqLM.generate) and CTranslate2 (SentencePiece pieces into
Translator.translate_batch). The libraries get only the export directory and its README's calls: no
token appended by hand, no id of ours. Every comparison of ours with theirs is made where all three rank
hypotheses by the same numbers, so it holds whichever machine trained the run (XLA:CPU's floats differ
between AVX2 and AVX-512): greedy output, and beam search with alpha 0 (no length penalty: ours is GNMT's,
theirs L^alpha), must be identical in float32 (short of a length limit). With the export's own settings
(the run's alpha), the two libraries, which share L^alpha, agree with each other.

The default suite covers the README's recipe for your own corpus (pre-norm, source EOS: Pegasus);
`-m slow` adds post-norm (Marian) and runs without source EOS. The four combinations come from one trained
pair (pre-norm with source EOS, post-norm without): the other source-EOS setting of a layer order is its
run with config.data.source_eos flipped, since that flag alone decides how each system feeds a source.
"""
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys

import pytest

ctranslate2 = pytest.importorskip("ctranslate2", reason="the interop extra (pip install -e '.[interop]')")
torch = pytest.importorskip("torch", reason="the interop extra (pip install -e '.[interop]')")
transformers = pytest.importorskip("transformers", reason="the interop extra (pip install -e '.[interop]')")
import sentencepiece as spm

from decode import __main__ as decode_cli
from decode.bleu import sacrebleu_score
from export import __main__ as export_cli
from files_config import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A toy language pair: every English word has one translation, and adjectives follow their noun.
LEXICON = dict(the="el", a="un", cat="gato", dog="perro", bird="pajaro", fish="pez", house="casa",
               tree="arbol", river="rio", hill="cerro", red="rojo", blue="azul", big="grande",
               small="chico", sees="ve", eats="come", likes="quiere", near="cerca", under="bajo")
ADJECTIVES = ("red", "blue", "big", "small")
NOUNS = ("cat", "dog", "bird", "fish", "house", "tree", "river", "hill")
STEPS = 300   # enough for a model that translates most test sentences, not all


def toy_pair(rng):
  def phrase():
    words = [rng.choice(("the", "a"))] + [rng.choice(ADJECTIVES) for _ in range(rng.randint(0, 1))]
    return words + [rng.choice(NOUNS)]
  src = phrase() + [rng.choice(("sees", "eats", "likes"))] + phrase()
  if rng.random() < 0.4:
    src += [rng.choice(("near", "under"))] + phrase()
  tgt, i = [], 0
  while i < len(src):   # "the red cat" -> "el gato rojo"
    if src[i] in ADJECTIVES:
      tgt += [LEXICON[src[i + 1]], LEXICON[src[i]]]
      i += 2
    else:
      tgt.append(LEXICON[src[i]])
      i += 1
  return " ".join(src) + " .", " ".join(tgt) + " ."


def write_corpus(folder: pathlib.Path) -> dict:
  """Writes train/dev/test.tsv (no test or dev source in train); returns the splits' pairs."""
  rng = random.Random(0)
  held_out, splits = set(), {}
  for split, n in (("test", 300), ("dev", 40), ("train", 3000)):
    pairs = []
    while len(pairs) < n:
      pair = toy_pair(rng)
      if pair[0] not in held_out:
        pairs.append(pair)
        if split != "train":
          held_out.add(pair[0])
    splits[split] = pairs
    (folder / f"{split}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
  return splits


def train_tiny(folder: pathlib.Path, pre_norm: bool, source_eos: bool) -> pathlib.Path:
  """Trains a 1+1-layer model on the toy corpus in `folder` with `python -m train`; returns its run
  directory. On one CPU device: eight fake devices' all-reduce makes XLA abort the process when a
  loaded machine starves one of their threads for long enough."""
  workdir = folder / f"run_{'pre' if pre_norm else 'post'}_{'eos' if source_eos else 'noeos'}"
  settings = dict(
      model=dict(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, max_len=48,
                 pre_norm=pre_norm),
      data=dict(source="files", train_path=folder / "train.tsv", dev_path=folder / "dev.tsv",
                test_path=folder / "test.tsv", vocab_size=64, vocab_sample_sentences=3000, batch_tokens=512,
                max_len=48, source_eos=source_eos),
      train=dict(num_steps=STEPS, warmup_steps=30, learning_rate=1e-2, log_every=100, eval_every=10_000,
                 bleu_every=0, checkpoint_every_steps=10_000, test_bleu=False, tensorboard=False,
                 progress=False),
      decode=dict(beam_size=4, alpha=0.6))
  flags = [f"--config.{section}.{key}={value}" for section, values in settings.items()
           for key, value in values.items()]
  env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=1"))
  subprocess.run([sys.executable, "-m", "train", "--config", f"{ROOT}/experiments/default.py:smoke",
                  "--workdir", str(workdir), *flags], check=True, cwd=ROOT, env=env,
                 stdout=subprocess.DEVNULL)
  return workdir


# ----------------------------------------------------------------------------------------------------
# Three ways to translate: ours, and each library as its documentation shows.
# ----------------------------------------------------------------------------------------------------
def ours(workdir, sources, tmp_path, greedy: bool, alpha=None) -> list[str]:
  """`python -m decode` (in this process): greedy (--temperature 0), or the run's beam with `alpha` (None:
  the run's)."""
  src, out = tmp_path / "ours.src", tmp_path / f"ours_{greedy}_{alpha}.hyp"
  src.write_text("".join(s + "\n" for s in sources))
  decode_cli.main(["--workdir", str(workdir), "--input", str(src), "--output", str(out)]
                  + (["--temperature", "0"] if greedy else [])
                  + ([] if alpha is None else ["--alpha", str(alpha)]))
  return out.read_text().splitlines()


def hugging_face(out_dir, sources, greedy: bool, alpha=None) -> list[str]:
  """AutoTokenizer + AutoModelForSeq2SeqLM.generate, called as the directory's README says (the
  generation settings come from generation_config.json; `alpha` overrides its length_penalty)."""
  tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
  model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out_dir).eval()
  source_eos = json.loads((out_dir / "aiayn_export.json").read_text())["source_eos"]
  batch = tokenizer(sources, padding=True, return_tensors="pt", add_special_tokens=source_eos)
  settings = dict(num_beams=1, do_sample=False) if greedy else {}
  if alpha is not None:
    settings["length_penalty"] = alpha
  with torch.no_grad():
    generated = model.generate(**batch, **settings)
  return tokenizer.batch_decode(generated, skip_special_tokens=True)


def ct2(out_dir, sources, greedy: bool, alpha=None) -> list[str]:
  """SentencePiece pieces into ctranslate2.Translator.translate_batch, as CTranslate2's docs show (`alpha`:
  the length_penalty, None: the run's)."""
  sp = spm.SentencePieceProcessor(model_file=str(out_dir / "source.spm"))
  settings = json.loads((out_dir / "aiayn_export.json").read_text())
  translator = ctranslate2.Translator(str(out_dir), device="cpu", intra_threads=1)
  results = translator.translate_batch(
      sp.encode(sources, out_type=str), beam_size=1 if greedy else settings["beam_size"],
      length_penalty=settings["alpha"] if alpha is None else alpha, patience=2,
      max_decoding_length=settings["max_len"], min_decoding_length=0)
  return [sp.decode(r.hypotheses[0]) for r in results]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """(folder, splits) of the toy corpus, written once."""
  folder = tmp_path_factory.mktemp("toy")
  return folder, write_corpus(folder)


@pytest.fixture(scope="module")
def trained(corpus):
  """pre_norm -> the run of the trained pair: pre-norm with source EOS, post-norm without (trained once)."""
  runs = {}

  def get(pre_norm: bool) -> pathlib.Path:
    if pre_norm not in runs:
      runs[pre_norm] = train_tiny(corpus[0], pre_norm, source_eos=pre_norm)
    return runs[pre_norm]
  return get


def run_with(trained, pre_norm: bool, source_eos: bool, tmp_path) -> pathlib.Path:
  """The pair's run of this layer order, as trained, or a copy of it with config.data.source_eos flipped."""
  workdir = trained(pre_norm)
  if source_eos == pre_norm:
    return workdir
  flipped = tmp_path / "flipped"
  shutil.copytree(workdir, flipped)
  config = json.loads((flipped / "config.json").read_text())
  config["data"]["source_eos"] = source_eos
  (flipped / "config.json").write_text(json.dumps(config, indent=1))
  return flipped


def check_exports_translate_like_decode(workdir, splits, tmp_path, pre_norm: bool, source_eos: bool):
  sources = [s for s, _ in splits["test"]]
  references = [t for _, t in splits["test"]]
  exports = {}
  for fmt in ("hf", "ctranslate2"):
    exports[fmt] = tmp_path / f"export_{fmt}"
    export_cli.main(["--workdir", str(workdir), "--format", fmt, "--out", str(exports[fmt])])
  config = json.loads((exports["hf"] / "config.json").read_text())
  assert config["architectures"] == ["PegasusForConditionalGeneration" if pre_norm else "MarianMTModel"]
  assert json.loads((exports["ctranslate2"] / "config.json").read_text())["add_source_eos"] == source_eos
  run = json.loads((workdir / "config.json").read_text())["decode"]
  generation = json.loads((exports["hf"] / "generation_config.json").read_text())
  assert (generation["num_beams"], generation["length_penalty"]) == (run["beam_size"], run["alpha"]) == (4, 0.6)

  greedy = ours(workdir, sources, tmp_path, greedy=True)
  assert len(set(greedy)) > len(sources) // 2 and sum(g == r for g, r in zip(greedy, references)) >= 5
  # Identical where ours ended well short of a length limit (the limits differ: docs/runs.md): a toy
  # model that repeats a word until a limit is cut at a different token by each library.
  sp = spm.SentencePieceProcessor(model_file=str(exports["ctranslate2"] / "target.spm"))
  limit = json.loads((exports["ctranslate2"] / "aiayn_export.json").read_text())["max_len"] - 8
  ended = [i for i, g in enumerate(greedy) if len(sp.encode(g)) < limit]
  assert len(ended) >= 0.9 * len(sources)
  for theirs in (hugging_face(exports["hf"], sources, greedy=True),
                 ct2(exports["ctranslate2"], sources, greedy=True)):
    assert [theirs[i] for i in ended] == [greedy[i] for i in ended]

  # Beam search with alpha 0: every system ranks hypotheses by their summed log-probabilities (ours divides
  # by GNMT's ((5 + L) / 6)^alpha, the libraries by L^alpha: 1 for both), so the beams are the same too.
  beam = ours(workdir, sources, tmp_path, greedy=False, alpha=0.0)
  assert 20 < sacrebleu_score(beam, references)[0] < 100   # a model that translates, not perfectly
  ended = [i for i, g in enumerate(beam) if len(sp.encode(g)) < limit]
  assert len(ended) >= 0.9 * len(sources)
  for theirs in (hugging_face(exports["hf"], sources, greedy=False, alpha=0.0),
                 ct2(exports["ctranslate2"], sources, greedy=False, alpha=0.0)):
    assert [theirs[i] for i in ended] == [beam[i] for i in ended]

  # The exports' own settings, as their READMEs call them: the run's beam and alpha, which both libraries
  # divide by L^alpha. Ours ranks some hypotheses differently with the same alpha (docs/runs.md: the BLEU
  # moved by up to 0.7 on this toy model, 0.2 on a real corpus), so only the two libraries are compared.
  bleu = {"hf": sacrebleu_score(hugging_face(exports["hf"], sources, greedy=False), references)[0],
          "ct2": sacrebleu_score(ct2(exports["ctranslate2"], sources, greedy=False), references)[0]}
  assert 20 < bleu["hf"] < 100 and abs(bleu["hf"] - bleu["ct2"]) <= 0.5, bleu


def test_pre_norm_with_source_eos_translates_like_decode(trained, corpus, tmp_path):
  """The README's recipe for your own corpus (experiments/small_corpus.py): pre-norm, source EOS."""
  workdir = run_with(trained, True, True, tmp_path)
  check_exports_translate_like_decode(workdir, corpus[1], tmp_path, pre_norm=True, source_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("pre_norm,source_eos", [(False, False), (False, True), (True, False)])
def test_every_layer_order_and_source_eos_translates_like_decode(trained, corpus, tmp_path, pre_norm, source_eos):
  workdir = run_with(trained, pre_norm, source_eos, tmp_path)
  check_exports_translate_like_decode(workdir, corpus[1], tmp_path, pre_norm=pre_norm, source_eos=source_eos)
