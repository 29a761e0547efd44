"""benchmarks/accelerator.py and benchmarks/remat_scan.py: their pieces, and docs quoting their JSON."""
import json
import pathlib

import jax
import pytest

from benchmarks import accelerator, remat_scan
from model import Compute, TransformerConfig

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "accelerators.md"


@pytest.mark.parametrize("pattern, render", [("remat_scan-*.json", remat_scan.render),
                                             ("*-check*.json", accelerator.render)], ids=["remat_scan", "check"])
def test_docs_quote_the_results(pattern, render):
  """docs/accelerators.md holds the table `render` makes of every results file: remat_scan's and each
  committed device check's."""
  page = DOCS.read_text()
  files = sorted(accelerator.RESULTS.glob(pattern))
  assert files, f"no results matching {pattern}"
  for path in files:
    assert render(json.loads(path.read_text())) in page, f"{path.name}: docs are stale"


def test_check_command_names_the_attention_and_sizes_models_for_a_cpu():
  impl = accelerator.attention_impl("cpu")
  assert impl == "xla (auto)"
  cfg = accelerator.model_config("big", "cpu", remat="full")
  assert (cfg.d_model, cfg.compute.dtype, cfg.compute.remat) == (128, "bfloat16", "full")
  assert accelerator.model_config("big", "gpu").d_model == 1024   # the paper's size elsewhere


@pytest.mark.slow
def test_largest_batch_search_stops_at_the_budget():
  cfg = TransformerConfig(vocab_size=100, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
                          num_decoder_layers=1, max_len=64, compute=Compute(kernels="reference"))
  devices = jax.devices()[:1]
  small = accelerator.Step(cfg, rows=2, seq_len=16, devices=devices).memory()["footprint"]
  found = accelerator.largest_batch(cfg, 16, budget=small * 3, start_tokens=32, max_tokens=16 * 64,
                                    devices=devices)
  assert 32 <= found["tokens_per_device"] < 16 * 64 and found["footprint"] <= small * 3


@pytest.mark.slow
def test_remat_scan_smoke_measures_every_part():
  result = remat_scan.main(["--smoke", "--part", "memory,scan"])
  assert set(result["memory"]["scanned/ratios"]) == {"none", "minimal", "full"}
  assert result["memory"]["scanned/ratios"]["full"] < 1.0    # remat keeps less inside a scan
  assert result["scan"]["compile_s"]["scanned"][0] > 0


def test_a_check_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
  """The results file is rewritten whole after each part: a run stopped at its time limit keeps them."""
  def cut_short(*args, save):
    save({"backend": "gpu", "models": {"base": {"step_s": 0.025}}})
    raise TimeoutError("the node's time limit")
  monkeypatch.setattr(accelerator, "run", cut_short)
  out = tmp_path / "check.json"
  with pytest.raises(TimeoutError):
    accelerator.main(["--out", str(out), "--note", "cut"])
  got = json.loads(out.read_text())
  assert (got["complete"], got["note"], got["models"]["base"]["step_s"]) == (False, "cut", 0.025)
  assert [p.name for p in tmp_path.iterdir()] == ["check.json"]   # no half-written file beside it

  monkeypatch.setattr(accelerator, "run", lambda *args, save: {"backend": "gpu", "models": {}})
  accelerator.main(["--out", str(out)])
  assert json.loads(out.read_text())["complete"] is True


def test_the_fixed_cost_is_the_intercept_of_the_sweep():
  fit = accelerator.fit_fixed_cost([(8000, 0.013), (16000, 0.021), (32000, 0.037)])
  assert fit["fixed_ms"] == pytest.approx(5.0) and fit["ms_per_1k_tokens"] == pytest.approx(1.0)
