"""Your own small parallel corpus (20k-100k pairs) on a 2-core CPU.

Command (your files: TSV "source<TAB>target", or two line-aligned files joined by a comma):
  python -m train --config experiments/small_corpus.py --workdir runs/mine \\
      --config.data.train_path=train.tsv --config.data.dev_path=dev.tsv --config.data.test_path=test.tsv \\
      --config.data.src_lang=en --config.data.tgt_lang=de
(src_lang/tgt_lang only label the run: the files give the direction.) Then:
  python -m decode --workdir runs/mine --checkpoint averaged --input FILE --output FILE
Smoke (seconds, offline, on the embedded corpus): python -m train --config experiments/small_corpus.py:smoke
  --workdir /tmp/small_smoke

Expected and cost: the default experiment's cost (1,000 steps of 2,048 tokens at 1.9M parameters, about
10 minutes on 2 idle cores). Measured so far (docs/small_corpus.md, 2026-11-23, on the 81k-pair
English->German software-message corpus of scripts/build_po_corpus.py, on a heavily shared machine):
dev loss 4.09 at step 500; test sacreBLEU on 500 test sentences at step 500: 3.54, BELOW the default settings' 7.47 at the same
step. The full 1,000-step comparison is still to be run, and these settings are not yet shown to beat
the default's (the issue asks for 1.7x); see docs/small_corpus.md for what to try next.

Why these settings (untested choices, not yet measured to help; the default experiment is tuned for the synthetic corpus, which has no noise and
nothing to overfit; a real corpus of this size is seen 4-6 times in the budget):
- vocabulary by corpus size (config.data.vocab_size=0: 16 * sqrt(pairs), 4,500 pieces for 75k pairs): a
  smaller output layer, whose cost pays for a third encoder and decoder layer at the default's cost per
  token (1.9M parameters either way at d_model 128);
- dropout 0.1 on the residual branches and label smoothing 0.1, for repeated passes over noisy text;
- EOS at the end of every source (data.source_eos), as tensor2tensor and fairseq do;
- 1,000 steps of 2,048 tokens, as the default (the same compute), with a dev loss evaluation every 100
  steps (500 dev pairs) and early stopping after 3 evaluations without improvement;
- a checkpoint every 50 steps and the average of the last 5 (config.train.average_last): the end prints
  test BLEU of both the final and the averaged parameters, and writes the average to workdir/averaged.
"""
import ml_collections

from experiments import default

ARGS = (None, "smoke")


def get_config(arg=None):
  if arg not in ARGS + ("",):
    raise ValueError(f"experiments/small_corpus.py: unknown arg {arg!r}; use '' or 'smoke'")
  config = default.get_config()
  config.workdir = "runs/small_corpus"
  config.model.update(num_encoder_layers=3, num_decoder_layers=3, dropout_rate=0.1)
  config.data.update(source="files", src_lang="en", tgt_lang="de",
                     vocab_size=0,              # by corpus size (data.vocab.auto_vocab_size)
                     source_eos=True)
  config.train.update(num_steps=1000, warmup_steps=200, learning_rate=2e-3, label_smoothing=0.1,
                      eval_every=100, early_stop_evals=3, dev_sentences=500,
                      checkpoint_every_steps=50, keep_checkpoints=5, average_last=5)

  if arg == "smoke":
    smoke = default.get_config("smoke")
    config.workdir = "runs/small_corpus_smoke"
    config.model.update(**{k: smoke.model[k] for k in ("d_model", "d_ff", "num_heads", "num_encoder_layers",
                                                       "num_decoder_layers")})
    config.data.update(**smoke.data.to_dict())   # the embedded corpus (offline)
    config.data.source_eos = True
    config.train.update(num_steps=4, warmup_steps=2, log_every=1, eval_every=1, checkpoint_every_steps=1,
                        keep_checkpoints=2, average_last=2, dev_sentences=64, test_sentences=64)
  return config
