"""The training driver's evaluations: dev loss, BLEU by beam search, early stopping and the end's test report.

train/train.py calls them with its run (run.RunDir), metrics writer and Outcome, which report_test and
best_step_line fill in and read. Every process runs them on its own devices and its own share of the
sentences (train/multihost.py); process 0 writes and says what they measure.
"""
from __future__ import annotations

import pathlib

import jax
import numpy as np

from data import load_pairs, source_eos, tasks
from decode.bleu import sacrebleu_score
from decode.translate import translate
from run import RunDir, layout
from train import multihost
from train import step as step_lib
from train.average import average_and_test
from train.multihost import say

# A periodic dev BLEU translates this many sentences between looks at the signal flag, so that SIGTERM
# (SLURM's time limit, jobs.submit --save_window) cuts a long dev evaluation short and the run saves.
BLEU_CHUNK = 512


def dev_losses(eval_fn, params, batches, mesh, stop=lambda: False) -> dict | None:
  """Dev loss/ppl/accuracy over a list of host batches (one device-to-host fetch at the end); None where
  stop() (asked after each batch: a signal, the same answer in every process) cut it short."""
  outs = []
  for batch in batches:
    outs.append(eval_fn(params, step_lib.place_batch(batch, mesh)))
    if len(outs) > 1:
      jax.block_until_ready(outs[-2])   # one batch in flight, so that a signal is seen within a batch
    if stop():
      return None
  outs = jax.device_get(outs)
  sums = {key: float(np.sum([np.float64(out[key]) for out in outs])) for key in outs[0]}
  return step_lib.finish_eval(sums)


def bleu(model, params, vocab, pairs, decode_config, source_eos, stop=None):
  """Beam-search translations of pairs' sources -> (sacreBLEU, signature, hypotheses).

  With several processes each translates its share of the sentences on its own devices, and all get all
  the hypotheses (the same ones as one process would find). stop: asked before each BLEU_CHUNK sentences
  (a dev evaluation a signal may cut short: then None); None: all in one go.
  """
  model, host_params = layout.unrolled(model, multihost.host_tree(params))   # decoding reads layer by layer
  sources, hyps = [s for s, _ in pairs], []
  chunk = BLEU_CHUNK if stop is not None else max(len(sources), 1)
  for first in range(0, len(sources), chunk):
    if stop is not None and stop():
      return None
    hyps += multihost.map_split(
        lambda part: translate(model, host_params, vocab, part, beam_size=decode_config.beam_size,
                               alpha=decode_config.alpha, max_extra_len=decode_config.max_extra_len,
                               batch_tokens=decode_config.batch_tokens, source_eos=source_eos),
        sources[first:first + chunk])
  score, signature = sacrebleu_score(hyps, [t for _, t in pairs])
  return float(score), signature, hyps


def early_stop(early: dict, dev_loss: float, patience: int, step: int) -> bool:
  """config.train.early_stop_evals: updates `early` (the best dev loss and its step, the evals since it,
  whether the run has stopped; saved in every checkpoint) with one evaluation's dev loss. -> whether it
  is a new best (the caller saves and keeps that step's checkpoint)."""
  better = dev_loss < early["best"]
  early.update(best=min(early["best"], dev_loss), bad=0 if better else early["bad"] + 1)
  if better:
    early["best_step"] = step
  if early["bad"] >= patience:
    early["stopped"] = True
    say(f"\n[train] dev loss has not improved for {patience} evals (best {early['best']:.4f} at step "
        f"{early.get('best_step')}); stopping at step {step}")
  return better


def best_step_line(outcome, best_loss: float, path: pathlib.Path) -> str:
  """What the end of a run with config.train.early_stop_evals says of its model: early stopping only where
  the run stopped early; a run that trained all its steps names the step it keeps as best."""
  kept = (f"its checkpoint ({path}) is kept and is the run's model: the test BLEU below, decode and export "
          f"read it (--checkpoint latest: step {outcome.step})")
  if outcome.stopped_early:
    return (f"[train] early stopping: stopped at step {outcome.step}; the best dev loss, {best_loss:.4f}, was "
            f"at step {outcome.best_step}; {kept}")
  return (f"[train] trained all {outcome.step} steps (no early stop); the best dev loss, {best_loss:.4f}, was "
          f"at step {outcome.best_step}: {kept}")


def report_test(config, run: RunDir, model, params, vocab, writer, step, outcome) -> None:
  """The end: test-set sacreBLEU of `params` (the final ones, or early stopping's best: metrics.jsonl's
  test/checkpoint_step names its step), of the average of the last config.train.average_last
  checkpoints (the paper's reported models) and a few sample translations."""
  tc = config.train
  scores = tc.test_bleu and tasks.translates(config.data)
  test = None   # parameters -> test BLEU
  if scores:
    test_pairs = load_pairs(config.data, "test")
    if tc.get("test_sentences", 0):
      test_pairs = test_pairs[:tc.test_sentences]
    bleu_of = lambda params: bleu(model, params, vocab, test_pairs, config.decode, source_eos(config.data))
    score, signature, hyps = bleu_of(params)
    which = {} if outcome.best_step is None else {"test/checkpoint_step": outcome.best_step}
    writer.write(step, {"test/bleu": score, "test/signature": signature, **which})
    outcome.test_bleu, outcome.test_signature = score, signature
    outcome.samples = [(s, t, h) for (s, t), h in list(zip(test_pairs, hyps))[:tc.num_samples]]
    test = lambda params: bleu_of(params)[0]
  if int(tc.get("average_last", 0)):
    outcome.averaged_steps, outcome.test_bleu_averaged = average_and_test(
        run, int(tc.average_last), test, writer, step, bool(tc.get("average_allow_fewer", False)))
