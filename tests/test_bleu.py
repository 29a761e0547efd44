"""decode/bleu.py: the paper's tokenized BLEU as tensor2tensor's get_ende_bleu.sh computes it (Moses
tokenizer.perl -l de, the ##AT## compound split, multi-bleu.perl), on sentences with hyphens, quotes and
numbers; the expected value is counted by hand below."""
import math
import shutil
import subprocess

import pytest

from decode import bleu

HYPS = ["„Rhein-Main“ ist 1.000,5 km lang.", "Er sagte: \"Das ist's.\"", "Die A-B-C-Straße hat 3 Spuren."]
REFS = ["„Rhein-Main“ ist 1.000,5 Kilometer lang.", "Er sagte: \"Das war's, oder?\"",
        "Die A-B-C-Straße hat drei Spuren."]
AT = "##AT##-##AT##"


def test_moses_tokenizer_as_tokenizer_perl_does_it():
  """tokenizer.perl -l de's documented rules: punctuation split off except inside numbers (1.000,5) and
  words (A-B-C-Straße: no -a); '"' -> &quot; and "'" -> &apos; split off (German splits every
  apostrophe); a single letter before a period is a non-breaking prefix ("s." stays)."""
  assert bleu.moses_tokenize(HYPS[0], "de") == "„ Rhein-Main “ ist 1.000,5 km lang ."
  assert bleu.moses_tokenize(HYPS[1], "de") == "Er sagte : &quot; Das ist &apos; s. &quot;"
  assert bleu.moses_tokenize(REFS[1], "de") == "Er sagte : &quot; Das war &apos; s , oder ? &quot;"
  assert bleu.moses_tokenize("x & y | [z] < 3", "de") == "x &amp; y &#124; &#91; z &#93; &lt; 3"


def test_compound_split_is_one_non_overlapping_pass():
  assert bleu.split_compounds("Rhein-Main") == f"Rhein {AT} Main"
  assert bleu.split_compounds("A-B-C-Straße") == f"A {AT} B-C {AT} Straße"   # perl's s///g, from the left
  assert bleu.split_compounds("a - b --c 2013-2014") == f"a - b - {AT} c 2013 {AT} 2014"


@pytest.mark.skipif(shutil.which("perl") is None, reason="needs perl to run get_ende_bleu.sh's one-liner")
def test_compound_split_equals_the_scripts_perl_one_liner():
  lines = [bleu.moses_tokenize(line, "de") for line in HYPS + REFS] + ["a-b-c-d e--f -g h- x-y-z"]
  perl = subprocess.run(["perl", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"], input="\n".join(lines) + "\n",
                        capture_output=True, text=True, check=True).stdout.splitlines()
  assert [bleu.split_compounds(line) for line in lines] == perl


def test_paper_bleu_equals_multi_bleu_counted_by_hand():
  # After tokenizing and splitting, per sentence: (hypothesis words, reference words) and for n = 1..4
  # (clipped matches, hypothesis n-grams), counted by hand:
  #   1: „ Rhein @ Main “ ist 1.000,5 km lang .  vs  ... Kilometer ...   10/10 words: 9/10 7/9 5/8 4/7
  #   2: Er sagte : &quot; Das ist &apos; s. &quot;  vs  Er sagte : &quot; Das war &apos; s , oder ? &quot;
  #      9/12 words: 7/9 4/8 3/7 2/6
  #   3: Die A @ B-C @ Straße hat 3 Spuren .  vs  ... drei ...   10/10 words: 9/10 7/9 5/8 4/7
  # Corpus: 25/29 18/26 13/23 10/20; 29 hypothesis words against 32 reference words: brevity penalty.
  expected = 100 * math.exp(1 - 32 / 29) * (25 / 29 * 18 / 26 * 13 / 23 * 10 / 20) ** 0.25
  assert bleu.paper_bleu(HYPS, REFS, "de") == pytest.approx(expected, abs=1e-9)   # 57.79
  score, signature = bleu.paper_bleu_score(HYPS, REFS, "de")
  assert score == pytest.approx(expected, abs=1e-9)
  assert signature.startswith("tok:moses-de+compound-split|sacremoses:") and "multi-bleu.perl" in signature


def test_multi_bleu_zero_precision_and_lengths():
  assert bleu.multi_bleu(["a b c"], ["a b c"]) == 0.0          # no 4-gram: multi-bleu.perl prints 0
  assert bleu.multi_bleu(["a b c d"], ["a b c d"]) == pytest.approx(100.0)
  assert bleu.multi_bleu(["a b c d"], ["a b c d e f"]) == pytest.approx(100 * math.exp(1 - 6 / 4))
  with pytest.raises(ValueError, match="2 hypotheses and 1 references"):
    bleu.paper_bleu(["a", "b"], ["a"])
