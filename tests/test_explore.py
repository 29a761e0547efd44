"""python -m decode.explore: the attention explorer's answers (the attention it shows is
decode.attention_maps', for the encoder-decoder, decoder-only and encoder-only models; bad input is a
message; two clients at once get their own answers), and its page in a real browser (Debian's headless
Chromium driven by selenium): typing a sentence gives `python -m decode`'s translation, layers x heads
panels of each kind, a hovered piece highlights its row, the bad inputs show their messages, and the
--html file shows the same panels with the network off.

The runs are written the way training writes one (config.json, vocab.model, an Orbax checkpoint) from a
tiny randomly initialised model, as tests/test_translate.py's: what is checked does not depend on
training. The browser tests skip, naming what is missing, where selenium, chromium or chromedriver is
not installed (`bash scripts/browser_local.sh` installs the browser on Debian).
"""
import json
import os
import pathlib
import re
import shutil
import threading
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import experiments
from data import synthetic
from data.lm import MASK, SEP
from data.vocab import BOS, EOS, VOCAB_FILE, Vocab, train_vocab
from decode import explore
from decode.__main__ import main as decode_main
from decode.attention_maps import attention_maps
from decode.beam_search import length_penalty
from decode.translate import translate
from model import Transformer
from run import checkpoint as ckpt
from run import config as config_io
from run.mesh import make_mesh

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = dict(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=2, num_decoder_layers=2, max_len=32,
             dropout_rate=0.0)
SENTENCE = "a dog runs."       # 8 pieces of the tests' vocabulary
OTHER = "the bird"           # 4: one length bucket, one compiled search for both
KINDS = {"default": ("enc_self", "dec_self", "cross"), "decoder_only_mt": ("dec_self",),
         "lm": ("dec_self",), "mlm": ("enc_self",)}


@pytest.fixture(scope="module")
def vocab_bytes():
  pairs = synthetic.generate(0, {"train": 400})["train"]
  texts = [s for pair in pairs for s in pair]
  return train_vocab(texts, 300, seed=0, sample_sentences=len(texts))


def make_run(folder, experiment, vocab_bytes, *, checkpoint=True):
  """A run directory as training writes one, of experiments/EXPERIMENT.py:smoke with MODEL's sizes and
  randomly initialised parameters (scaled up, so that the model prefers some pieces, EOS among them)."""
  config = experiments.load_experiment(f"{ROOT}/experiments/{experiment}.py:smoke")
  model = {k: v for k, v in MODEL.items() if not (experiment == "mlm" and k == "num_decoder_layers")}
  config = experiments.apply_overrides(config, {**{f"model.{k}": v for k, v in model.items()},
                                                "decode.max_extra_len": 4})   # short outputs, quick searches
  folder.mkdir(parents=True)
  config_io.save_config(config, folder)
  (folder / VOCAB_FILE).write_bytes(vocab_bytes)
  if checkpoint:
    import run
    vocab = Vocab(vocab_bytes)
    net = Transformer(run.model_config(config, vocab.size))
    ones = jnp.ones((1, 4), jnp.int32)
    params = net.init({"params": jax.random.key(3)}, ones, ones)["params"]
    params = jax.tree_util.tree_map(lambda x: x * 3.0, params)
    manager = ckpt.make_manager(folder, async_save=False)
    ckpt.save(manager, 7, params, None, {"step": 7, "vocab_fingerprint": vocab.fingerprint})
    manager.wait_until_finished()
    manager.close()
  return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vocab_bytes):
  """experiment -> its run directory (made once per module)."""
  made = {}

  def get(experiment):
    if experiment not in made:
      made[experiment] = make_run(tmp_path_factory.mktemp(experiment) / "run", experiment, vocab_bytes)
    return made[experiment]
  return get


@pytest.fixture(scope="module")
def explorer(runs):
  return explore.Explorer(runs("default"))


# ------------------------------------------------------------------------------------------------------
# The answers (no browser).
# ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("experiment", ["default", "decoder_only_mt", "lm", "mlm"])
def test_the_attention_shown_is_decode_attention_maps_for_every_model(experiment, runs):
  workdir = runs(experiment)
  shown = explore.Explorer(workdir)
  text = "a [MASK] runs." if experiment == "mlm" else SENTENCE
  result = shown.analyze(text)   # the run's settings: beam 4, at most 4 more pieces (one compiled search)
  opened = shown.opened()
  vocab = opened.vocab
  ids = vocab.encode(text) if experiment != "mlm" else None
  if experiment == "default":
    src, tgt_in = ids, [BOS] + vocab.encode(result["output"])   # (its output: the two-clients test)
  elif experiment == "decoder_only_mt":
    src, tgt_in = [], [BOS, *ids, SEP, *vocab.encode(result["output"])]
    assert result["output"] == translate(opened.model, opened.params, vocab, [text], max_extra_len=4,
                                         mesh=make_mesh(jax.devices()[:1]))[0]
  elif experiment == "lm":
    (shown_rows,) = [a["rows"] for a in result["attention"]]
    src, tgt_in = [], [vocab.piece_to_id(p) for p in shown_rows]   # the continuation as searched
    assert tgt_in[:len(ids) + 1] == [BOS, *ids] and vocab.decode(tgt_in[len(ids) + 1:]) == result["output"]
    # The pieces' probabilities are those the search scored: the best's score is their log-probability
    # over the length penalty (where it ended with EOS within max_extra_len).
    if result["tokens"][-1]["piece"] == vocab.id_to_piece(EOS):
      np.testing.assert_allclose(result["nbest"][0]["score"],
                                 result["log_prob"] / float(length_penalty(len(result["tokens"]), 0.6)),
                                 rtol=1e-3)
  else:
    head, tail = text.split("[MASK]")
    src, tgt_in = vocab.encode(head) + [MASK] + vocab.encode(tail), []
    assert [t["masked"] for t in result["tokens"]].count(True) == 1
  expected = attention_maps(opened.model, opened.params, src, tgt_in)
  assert [a["kind"] for a in result["attention"]] == list(KINDS[experiment])
  for a in result["attention"]:
    weights = np.asarray(a["weights"])
    layers = MODEL["num_decoder_layers" if a["kind"] != "enc_self" else "num_encoder_layers"]
    assert weights.shape[:2] == (layers, MODEL["num_heads"])
    assert weights.shape[2:] == (len(a["rows"]), len(a["cols"]))
    for layer in range(layers):
      np.testing.assert_allclose(weights[layer], expected[(a["kind"], layer)],
                                 atol=0.6 * 10 ** -explore.DIGITS)   # sent rounded to DIGITS decimals
  # Each output piece's probability and top alternatives form a distribution's head, best first.
  for token in result["tokens"]:
    probabilities = [p for _, p in token["top"]]
    assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1.0 + 1e-3
    assert (token["p"] is None) == token["masked"]   # a mask's own probability is not shown
    assert token["masked"] or token["p"] <= probabilities[0] + 1e-4


def test_bad_input_is_a_one_line_message(explorer, tmp_path, vocab_bytes):
  cases = [("", {}, "empty"), ("   ", {}, "empty"),
           ("a ж cat", {}, "'ж' (U+0436)"),
           ("cat " * 40, {}, "more than the 32 the model reads"),
           (SENTENCE, {"beam_size": "two"}, "beam size: 'two' is not a whole number"),
           (SENTENCE, {"repetition_penalty": "1.3"}, "applies to sampling"),
           (SENTENCE, {"temperature": "-1"}, "temperature: -1.0 is below")]
  for text, settings, message in cases:
    with pytest.raises(explore.InputError, match=re.escape(message)) as error:
      explorer.analyze(text, settings)
    assert "\n" not in str(error.value)
  # Asked to, a long sentence is cut as python -m decode cuts it, and the page says so.
  cut = explorer.analyze("cat " * 40, {"truncate": True, "max_extra_len": 2})
  assert len(cut["source_pieces"]) == 32 and "only its first 32 pieces" in cut["notes"][0]
  # A run directory without a checkpoint: a message, until a checkpoint is there.
  empty = make_run(tmp_path / "empty", "default", vocab_bytes, checkpoint=False)
  waiting = explore.Explorer(empty)
  assert "no checkpoints" in waiting.info()["error"]
  with pytest.raises(explore.InputError, match="no checkpoints"):
    waiting.analyze(SENTENCE)


def _post(url, text, settings=None):
  request = urllib.request.Request(url + "api/analyze", json.dumps({"text": text, "settings": settings or {}})
                                   .encode(), {"Content-Type": "application/json"})
  with urllib.request.urlopen(request, timeout=600) as response:
    return json.loads(response.read())


@pytest.fixture(scope="module")
def served(explorer):
  """The page of the default run, served on a free port of 127.0.0.1 by a thread of this process."""
  server = explore.make_server(explorer, "127.0.0.1", 0)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}/"
  server.shutdown()
  server.server_close()


def test_two_clients_at_once_get_their_own_answers(served, explorer):
  sentences = [SENTENCE, OTHER, "", SENTENCE + " "]
  answers = [None] * len(sentences)

  def ask(i):
    answers[i] = _post(served, sentences[i])
  threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(sentences))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  opened = explorer.opened()
  for text, answer in zip(sentences, answers):
    if not text:
      assert "empty" in answer["error"]
      continue
    assert answer["result"]["input"] == text
    assert answer["result"]["output"] == translate(opened.model, opened.params, opened.vocab, [text],
                                                   max_extra_len=4)[0]
  with urllib.request.urlopen(served + "api/info") as response:
    info = json.loads(response.read())
  assert info["step"] == 7 and info["config"]["model"]["num_heads"] == 2


# ------------------------------------------------------------------------------------------------------
# In a real browser.
# ------------------------------------------------------------------------------------------------------

def _browser_or_skip():
  try:
    from selenium import webdriver
  except ImportError:
    pytest.skip("selenium is not installed: pip install -e '.[test]' -c constraints.txt")
  names = ("chromium", "chromium-browser", "google-chrome")
  chrome = next((shutil.which(n) for n in names if shutil.which(n)), None)
  driver = shutil.which("chromedriver")
  if chrome is None or driver is None:
    missing = "chromium" if chrome is None else "chromedriver"
    pytest.skip(f"no {missing} on PATH: bash scripts/browser_local.sh installs Debian's chromium and "
                f"chromium-driver")
  os.environ.setdefault("SE_OFFLINE", "true")   # selenium: use the driver given, download nothing
  options = webdriver.ChromeOptions()
  options.binary_location = chrome
  for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--window-size=1400,1000"):
    options.add_argument(flag)
  return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))


@pytest.fixture(scope="module")
def browser():
  driver = _browser_or_skip()
  yield driver
  driver.quit()


def _answers(browser):
  return int(browser.find_element("tag name", "body").get_attribute("data-answers") or 0)


def _submit(browser, text, truncate=None):
  """Types `text` into the page's sentence box, submits, waits for the answer; -> (message, output)."""
  from selenium.webdriver.support.ui import WebDriverWait
  before = _answers(browser)
  box = browser.find_element("id", "text")
  box.clear()
  box.send_keys(text)
  if truncate is not None and browser.find_element("id", "truncate").is_selected() != truncate:
    browser.find_element("id", "truncate").click()
  browser.find_element("id", "go").click()
  WebDriverWait(browser, 600).until(lambda b: _answers(b) > before)
  message = browser.find_element("id", "message")
  shown = browser.find_element("id", "result").is_displayed()
  return (message.text if message.is_displayed() else None,
          browser.find_element("id", "output").text if shown else None)


def _panels(browser):
  return {kind: len(browser.find_elements("css selector", f'.kind[data-kind="{kind}"] .panel'))
          for kind in ("enc_self", "dec_self", "cross")}


def _has_class(browser, selector, name):
  return name in browser.find_element("css selector", selector).get_attribute("class").split()


@pytest.mark.slow
def test_the_page_translates_as_python_m_decode_shows_every_head_and_highlights(served, browser, runs,
                                                                               tmp_path):
  from selenium.webdriver.common.action_chains import ActionChains
  browser.get(served)
  assert "step 7" in browser.find_element("id", "run").text
  message, output = _submit(browser, SENTENCE)
  assert message is None
  source, hyp = tmp_path / "in.txt", tmp_path / "out.txt"
  source.write_text(SENTENCE + "\n")
  decode_main(["--workdir", str(runs("default")), "--input", str(source), "--output", str(hyp)])
  assert output == hyp.read_text().rstrip("\n")
  assert len(browser.find_elements("css selector", "#nbest tr.hyp")) == 4   # the run's beam size
  per_kind = MODEL["num_heads"] * MODEL["num_decoder_layers"]
  assert _panels(browser) == {"enc_self": MODEL["num_heads"] * MODEL["num_encoder_layers"],
                              "dec_self": per_kind, "cross": per_kind}
  # Hovering a piece of the enlarged head highlights its row (and dims the others).
  ActionChains(browser).move_to_element(
      browser.find_element("css selector", '#enlarged text.rowlabel[data-row="2"]')).perform()
  assert _has_class(browser, '#enlarged g.row[data-row="2"]', "hl")
  assert _has_class(browser, '#enlarged g.row[data-row="0"]', "dim")
  # Enlarge a cross-attention head; hovering an output piece highlights the row that chose it.
  browser.find_element("css selector", '.panel[data-kind="cross"][data-layer="1"][data-head="1"]').click()
  assert "cross-attention" in browser.find_element("id", "enlarged-title").text
  ActionChains(browser).move_to_element(
      browser.find_element("css selector", '#tokens tr.token[data-i="0"]')).perform()
  assert _has_class(browser, '#enlarged g.row[data-row="0"]', "hl")
  assert _has_class(browser, '#tokens tr.token[data-i="0"]', "hl")

  # The bad inputs: each a message on the page, never a trace.
  for text, expected in [("", "the input is empty"), ("a ж cat", "cannot encode 'ж'"),
                         ("cat " * 40, "more than the 32 the model reads")]:
    message, output = _submit(browser, text)
    assert expected in message and "Traceback" not in message and output is None
  message, output = _submit(browser, "cat " * 40, truncate=True)
  assert message is None and output is not None
  assert "only its first 32 pieces" in browser.find_element("id", "notes").text


@pytest.mark.slow
def test_a_run_without_a_checkpoint_is_a_message_on_the_page(browser, tmp_path, vocab_bytes):
  empty = make_run(tmp_path / "empty", "default", vocab_bytes, checkpoint=False)
  server = explore.make_server(explore.Explorer(empty), "127.0.0.1", 0)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    browser.get(f"http://127.0.0.1:{server.server_address[1]}/")
    shown = browser.find_element("id", "message")
    assert shown.is_displayed() and "no checkpoints" in shown.text
    message, output = _submit(browser, SENTENCE)
    assert "no checkpoints" in message and output is None
  finally:
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_the_html_file_shows_the_same_panels_offline(runs, browser, tmp_path, capsys):
  page = tmp_path / "view.html"
  explore.main(["--workdir", str(runs("default")), "--html", str(page), "--input", SENTENCE,
                "--input", OTHER])
  assert capsys.readouterr().out.strip() == str(page)
  text = page.read_text()
  assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "the file must not load anything"
  browser.execute_cdp_cmd("Network.enable", {})
  browser.execute_cdp_cmd("Network.emulateNetworkConditions",
                          {"offline": True, "latency": 0, "downloadThroughput": 0, "uploadThroughput": 0})
  try:
    browser.get(page.as_uri())
    assert _answers(browser) == 2 and not browser.find_element("id", "form").is_displayed()
    per_kind = MODEL["num_heads"] * MODEL["num_decoder_layers"]
    assert _panels(browser) == {"enc_self": MODEL["num_heads"] * MODEL["num_encoder_layers"],
                                "dec_self": per_kind, "cross": per_kind}
    opened = explore.Explorer(runs("default")).opened()
    expected = translate(opened.model, opened.params, opened.vocab, [SENTENCE], max_extra_len=4,   # the run's
                         mesh=make_mesh(jax.devices()[:1]))[0]
    assert browser.find_element("id", "output").text == expected
  finally:
    browser.execute_cdp_cmd("Network.emulateNetworkConditions",
                            {"offline": False, "latency": 0, "downloadThroughput": -1,
                             "uploadThroughput": -1})


def test_the_command_refuses_what_it_cannot_do_in_one_line(tmp_path, vocab_bytes, capsys):
  empty = make_run(tmp_path / "empty", "default", vocab_bytes, checkpoint=False)
  with pytest.raises(SystemExit) as exit_info:
    explore.main(["--workdir", str(empty), "--html", str(tmp_path / "x.html"), "--input", SENTENCE])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and "no checkpoints" in err and len(err.strip().splitlines()) == 1
  assert not (tmp_path / "x.html").exists()
  with pytest.raises(SystemExit) as exit_info:   # --html needs sentences
    explore.main(["--workdir", str(empty), "--html", str(tmp_path / "x.html")])
  assert exit_info.value.code == 2 and "--input" in capsys.readouterr().err
