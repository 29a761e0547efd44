"""Fine-tune a pretrained model (an imported OPUS-MT or Pegasus run, or any run of ours) on your corpus.

Command (a downloaded Helsinki-NLP/opus-mt-en-de directory; docs/pretrained.md):
    python -m export.load_hf --model opus-mt-en-de --workdir runs/opus-en-de
    python -m train --config experiments/finetune.py:runs/opus-en-de --workdir runs/opus-en-de-ft \\
        --config.data.train_path=train.tsv --config.data.dev_path=dev.tsv --config.data.test_path=test.tsv
    python -m export --workdir runs/opus-en-de-ft --format hf --out opus-en-de-ft
The argument is the pretrained run: its model section, vocabulary (config.data.vocab_file) and max length
are this run's, and train.init_checkpoint starts from its parameters with a fresh optimizer (step 0).
Expected: better test BLEU than the pretrained model on an in-domain corpus (score the pretrained run
with `python -m decode --reference` first); early stopping ends the run when the dev loss has not
improved for 3 evals. docs/pretrained_pipeline/README.md has a measured run on this machine.
Cost: at most 2,000 steps of the pretrained model (opus-mt-en-de: 74M parameters).
Smoke:    python -m train --config experiments/finetune.py:smoke --workdir /tmp/ft  (seconds; a tiny
          Marian-shaped model from scratch on the embedded corpus, since no pretrained run is at hand)

Why these settings: the pretrained weights are already good, so the step is small (peak 5e-5 where
training from scratch uses 1e-3 to 2e-3: larger steps forget the pretraining first) and the warmup
short (100 steps; Adam's moments start fresh either way), a cosine decay to 0 over 2,000 steps, and
early stopping on dev because a small corpus overfits a large model within an epoch or two. Dropout is
the pretrained model's (OPUS-MT's 0.1), label smoothing the paper's 0.1.
"""
import pathlib

import ml_collections

from experiments import default
from run.config import CONFIG_FILE, read_config_json
from data.vocab import VOCAB_FILE

ARGS = ("smoke",)   # and any pretrained run directory


def get_config(arg=None):
  config = default.get_config()
  config.workdir = "runs/finetune"
  config.data.update(source="files", source_eos=True, pack=True, batch_tokens=2048)
  config.data.vocab_file = ""      # the pretrained run's vocab.model (run.get_vocab copies it)
  config.train.update(schedule="cosine", learning_rate=5e-5, warmup_steps=100, num_steps=2000,
                      label_smoothing=0.1, eval_every=200, early_stop_evals=3, bleu_every=0,
                      checkpoint_every_steps=200, keep_checkpoints=3)
  if arg == "smoke":
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
  config.train.init_checkpoint = str(arg)
  config.decode.update({k: v for k, v in pretrained.get("decode", {}).items() if k in config.decode})
  return config
