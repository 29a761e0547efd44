"""Fine-tune a pretrained model (an imported OPUS-MT or Pegasus run, or any run of ours) on your corpus,
optionally with back-translated pairs.

Command (a downloaded Helsinki-NLP/opus-mt-en-de directory; docs/pretrained.md):
    python -m export.load_hf --model opus-mt-en-de --workdir runs/opus-en-de
    python -m train --config experiments/finetune.py:runs/opus-en-de --workdir runs/opus-en-de-ft \\
        --config.data.train_path=train.tsv --config.data.dev_path=dev.tsv --config.data.test_path=test.tsv
    python -m export --workdir runs/opus-en-de-ft --format hf --out opus-en-de-ft
The argument is the pretrained run: its model section, vocabulary (config.data.vocab_file) and max length
are this run's, and train.init_checkpoint starts from its parameters with a fresh optimizer (step 0).
Back-translated pairs (docs/back_translation.md): add --config.data.synthetic_path=synth.src,mono.tgt.
Their sources are tagged with "<BT>" where the pretrained vocabulary holds that piece (a run of ours
whose vocabulary reserved it, e.g. experiments/back_translation.py's), and go untagged otherwise: an
imported OPUS-MT vocabulary cannot hold a new piece (its ids are the pretrained model's rows). The
config says which (data.synthetic_tag: "<BT>" or ""), and the training log's stream line repeats it.
Expected: better test BLEU than the pretrained model on an in-domain corpus (score the pretrained run
with `python -m decode --reference` first). Early stopping ends the run when the dev loss has not
improved for 3 evals; the checkpoint of the best dev loss is kept however old, and is the run's model:
the final test BLEU, `python -m decode` and `python -m export` read it (the log names its step;
--checkpoint latest reads the last one). docs/pretrained_pipeline/README.md has a measured run here.
Cost: at most 2,000 steps of 2,048 tokens on a CPU (opus-mt-en-de: 74M parameters); on a GPU the same
tokens in 250 steps of 16,384 (for_platform below).
Smoke:    python -m train --config experiments/finetune.py:smoke --workdir /tmp/ft  (seconds; a tiny
          Marian-shaped model from scratch on the embedded corpus, since no pretrained run is at hand)

Why these settings: the pretrained weights are already good, so the step is small (peak 5e-5 where
training from scratch uses 1e-3 to 2e-3: larger steps forget the pretraining first) and the warmup
short (100 steps; Adam's moments start fresh either way), a cosine decay to 0 over 2,000 steps, and
early stopping on dev because a small corpus overfits a large model within an epoch or two. Dropout is
the pretrained model's (OPUS-MT's 0.1), label smoothing the paper's 0.1.

The platform (for_platform, applied by `python -m train` once JAX has started): on a CPU the sizes
above, float32 (XLA:CPU without AVX512-BF16 runs bfloat16 slower). On a GPU or TPU, bfloat16 compute
(compute.dtype, as the WMT experiments; parameters and Adam's state stay float32) and a batch of
GPU_BATCH_TOKENS, with every step count (steps, warmup, evals, checkpoints) divided by the batch's
ratio: the same tokens between evals and in all, the same schedule in passes over the corpus, in fewer
and fuller steps. The learning rate is kept (not measured at the larger batch). Any of these keys set on
the command line wins.
"""
import pathlib

import ml_collections

from experiments import default
from run.config import CONFIG_FILE, read_config_json
from data.mixing import holds_tag
from data.vocab import VOCAB_FILE, open_vocab

ARGS = ("smoke",)   # and any pretrained run directory
TAG = "<BT>"                 # back-translated sources' tag, where the pretrained vocabulary holds it
CPU_BATCH_TOKENS = 2048      # 4 rows of OPUS-MT's 512 positions: what 2 CPU cores step in seconds
GPU_BATCH_TOKENS = 16_384    # 32 rows of 512 positions: 8 x the CPU batch


def get_config(arg=None):
  config = default.get_config()
  config.workdir = "runs/finetune"
  config.data.update(source="files", source_eos=True, pack=True, batch_tokens=CPU_BATCH_TOKENS)
  config.data.vocab_file = ""      # the pretrained run's vocab.model (run.get_vocab copies it)
  # Back-translated pairs (data/mixing.py), declared so that the command line can set them.
  config.data.synthetic_path = ""
  config.data.synthetic_ratio = 0.0
  config.data.synthetic_tag = TAG
  config.train.update(schedule="cosine", learning_rate=5e-5, warmup_steps=100, num_steps=2000,
                      label_smoothing=0.1, eval_every=200, early_stop_evals=3, bleu_every=0,
                      checkpoint_every_steps=200, keep_checkpoints=3)
  if arg == "smoke":   # a vocabulary trained here, with the tag reserved
    config.model.update(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                        dropout_rate=0.1)
    config.model.update(activation="swish", logits_bias=True, layer_norm_epsilon=1e-5)
    config.data.update(source="synthetic", synthetic_train_size=2000, vocab_size=300,
                       vocab_sample_sentences=2000, batch_tokens=256, max_len=32)
    config.train.update(num_steps=2, warmup_steps=1, learning_rate=1e-3, log_every=1, eval_every=2,
                        checkpoint_every_steps=2, dev_sentences=64, test_sentences=64)
    return config
  if not arg or not (pathlib.Path(arg) / CONFIG_FILE).is_file():
    raise ValueError(f"experiments/finetune.py: unknown arg {arg!r}; use 'smoke' or a pretrained run "
                     f"directory (python -m export.load_hf writes one)")
  pretrained = read_config_json(pathlib.Path(arg) / CONFIG_FILE)
  config.model = ml_collections.ConfigDict({**config.model.to_dict(), **pretrained["model"]})
  config.compute = ml_collections.ConfigDict({**config.compute.to_dict(), **pretrained["compute"]})
  config.data.max_len = int(pretrained["data"].get("max_len", config.data.max_len))
  config.data.source_eos = bool(pretrained["data"].get("source_eos", True))
  config.data.vocab_file = str(pathlib.Path(arg) / VOCAB_FILE)
  if not vocab_holds_tag(config.data.vocab_file):
    config.data.synthetic_tag = ""   # an imported vocabulary: back-translated sources go untagged
  config.train.init_checkpoint = str(arg)
  config.decode.update({k: v for k, v in pretrained.get("decode", {}).items() if k in config.decode})
  return config


def vocab_holds_tag(vocab_file: str) -> bool:
  """Whether the pretrained run's vocab.model has TAG as one piece (a missing file: False; the trainer
  then names it)."""
  path = pathlib.Path(vocab_file)
  return path.is_file() and holds_tag(open_vocab(path.read_bytes(), str(path)), TAG)


def for_platform(config, platform: str) -> None:
  """The sizes of the device (module docstring): CPU as get_config has them, in float32 (whatever the
  pretrained run computed in); a GPU or TPU computes in
  bfloat16 with GPU_BATCH_TOKENS a batch and the step counts divided by the batch's ratio. The smoke
  variant keeps its tiny batch and steps and takes the dtype, so that it tries the device's path."""
  config.compute.dtype = "float32" if platform == "cpu" else "bfloat16"
  if platform == "cpu":
    return
  if config.data.source == "synthetic":   # smoke
    return
  ratio = GPU_BATCH_TOKENS // int(config.data.batch_tokens)
  config.data.batch_tokens = GPU_BATCH_TOKENS
  tc = config.train
  for key in ("num_steps", "warmup_steps", "eval_every", "checkpoint_every_steps"):
    tc[key] = max(1, -(-int(tc[key]) // ratio))
