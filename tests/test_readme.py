"""Every ```python block of the README runs as written, each on its own, as a user would run it
(a fresh interpreter outside the checkout, CPU devices: the XLA transport), and prints something.
Fragments that cannot run alone are written as ```py blocks, which this does not run."""

import os
import re

import pytest

from run_python import ROOT, run_python

with open(os.path.join(ROOT, "README.md")) as f:
    README = f.read()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)


def test_the_readme_has_runnable_examples_and_the_attention_layer_markers():
    assert BLOCKS, "the README has no python example"
    begin, end = README.find("<!-- attention-layer:begin -->"), README.find("<!-- attention-layer:end -->")
    use = README.find("\n## Use\n")
    assert 0 < use < begin < end, "the Use section starts with the attention layer's markers"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    out = run_python(["-c", BLOCKS[index]], timeout=600)
    assert out.strip(), f"README python block {index} printed nothing"
