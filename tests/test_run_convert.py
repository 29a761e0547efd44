"""`python -m run.convert`: a run rewritten in the scanned or the unrolled layout resumes and decodes."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model import Compute, Transformer, TransformerConfig
from run import checkpoint as ckpt, layout
from run.convert import convert_run, main

CFG = TransformerConfig(vocab_size=40, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=2,
                        num_decoder_layers=3, max_len=16, compute=Compute(kernels="reference"))


def _abstract(tree):
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


def _equal(a, b):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_convert_to_scanned_and_back(tmp_path):
  ids = jnp.ones((1, 3), jnp.int32)
  params = Transformer(CFG).init(jax.random.key(0), ids, ids)["params"]
  tx = optax.adam(1e-3)
  _, opt_state = tx.update(params, tx.init(params), params)   # moments that differ layer by layer
  run = tmp_path / "run"
  run.mkdir()
  config = {"seed": 0, "model": {"d_model": 16, "scan_layers": False}, "data": {}, "train": {}}
  (run / "config.json").write_text(json.dumps(config))
  (run / "metrics.jsonl").write_text('{"step": 3, "train/loss": 1.5}\n')
  manager = ckpt.make_manager(run, async_save=False)
  ckpt.save(manager, 3, params, opt_state, {"step": 3, "rng": [1, 2]})
  manager.close()

  main(["--workdir", str(run), "--out", str(tmp_path / "scanned"), "--scan_layers=True"])
  scanned_dir = tmp_path / "scanned"
  written = json.loads((scanned_dir / "config.json").read_text())   # in today's layout (the run's is older)
  assert written["model"] == {"d_model": 16} and written["compute"] == {"scan_layers": True}
  assert (scanned_dir / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
  # What resuming does: restore into the scanned model's own abstract state.
  scanned_model = Transformer(CFG.with_compute(scan_layers=True))
  abstract_params = jax.eval_shape(lambda: scanned_model.init(jax.random.key(0), ids, ids)["params"])
  abstract_params = _abstract(abstract_params)
  abstract_opt = _abstract(jax.eval_shape(tx.init, abstract_params))
  reader = ckpt.make_manager(scanned_dir, read_only=True)
  got_params, got_opt, meta, reader = ckpt.restore_latest(reader, abstract_params, abstract_opt)
  reader.close()
  assert meta == {"step": 3, "rng": [1, 2]}
  assert got_params["decoder"]["layers"]["ffn"]["wo"]["kernel"].shape == (3, 32, 16)
  _equal(got_params, layout.scan_params(params))
  _equal(got_opt[0].mu, layout.scan_params(opt_state[0].mu))

  with pytest.raises(FileExistsError):
    convert_run(scanned_dir, run, False)
  assert convert_run(scanned_dir, tmp_path / "back", False) == ["checkpoints/3"]
  back, step = ckpt.load_params(tmp_path / "back")
  assert step == 3
  _equal(back, params)


@pytest.mark.slow
def test_scanned_run_trains_averages_decodes_converts_and_resumes(tmp_path):
  """A smoke run with scanned layers: its average and its decoding (run.load_run unrolls it) work, and
  its unrolled conversion resumes to the numbers the scanned run itself reaches."""
  import experiments
  import run
  from decode.translate import translate
  from run import metrics as metrics_io
  from train.average import average_checkpoints
  from train.train import TIMING_KEYS, train_and_evaluate

  def config(steps, scan):
    c = experiments.load_experiment(str(pathlib.Path(__file__).resolve().parent.parent / "experiments"
                                        / "default.py") + ":smoke")
    return experiments.apply_overrides(c, {"train.num_steps": steps, "train.progress": False,
                                           "train.tensorboard": False, "train.test_bleu": False,
                                           "train.bleu_every": 0, "compute.scan_layers": scan})
  scanned = tmp_path / "scanned"
  train_and_evaluate(config(2, True), scanned)
  average_checkpoints(scanned, 1)
  opened = run.load_run(scanned, "averaged")
  assert not opened.model.cfg.compute.scan_layers and "layers_0" in opened.params["decoder"]
  assert translate(opened.model, opened.params, opened.vocab, ["the cat ."], beam_size=2, max_extra_len=3)
  convert_run(scanned, tmp_path / "unrolled", False)
  train_and_evaluate(config(4, False), tmp_path / "unrolled")
  train_and_evaluate(config(4, True), scanned)
  lines = lambda d: [{k: v for k, v in line.items() if k not in TIMING_KEYS and not isinstance(v, str)}
                     for line in metrics_io.read_metrics(d) if line["step"] > 2]
  for a, b in zip(lines(tmp_path / "unrolled"), lines(scanned), strict=True):
    assert a.keys() == b.keys()
    np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(b)], rtol=1e-4)
