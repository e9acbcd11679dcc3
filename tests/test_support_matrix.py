"""The README's support matrix of the attention layer says what the code does: its dtypes, its
cuDNN dtypes, its implementations, its tested R and its determinism flag, read from the code
and the tests, so that the table cannot drift from them."""

import os
import re

import jax.numpy as jnp

import test_attention
import test_attention_masks
import test_gpu_attention
from jax_cpgrad.attention import kernels, layer
from jax_cpgrad.attention.mosaic_gpu import config as mosaic_config

README = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
SECTION = README.split("<!-- attention-layer:begin -->")[1].split("<!-- attention-layer:end -->")[0]


def _matrix() -> dict[str, list[str]]:
    rows = [line for line in SECTION.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return {row[0]: row[1:] for row in cells[1:]}


def _names(dtypes) -> str:
    return ", ".join(jnp.dtype(d).name for d in dtypes)


def test_dtypes_row_lists_the_layers_dtypes():
    assert _matrix()["dtypes"] == [_names(layer._FLOAT_DTYPES)] * 3


def test_kernels_row_lists_the_cudnn_and_pallas_dtypes():
    for cell in _matrix()["kernels"]:
        assert f"cuDNN ({_names(kernels.cudnn.DTYPES)}" in cell and cell.endswith("XLA"), cell
        assert f"ours ({_names(mosaic_config.DTYPES)}" in cell, cell


def test_the_implementations_named_are_the_layers():
    named = re.search(r"`implementation=([^`]+)`", SECTION).group(1).split("|")
    assert {None if n == "None" else n.strip('"') for n in named} == {None, *layer.IMPLEMENTATIONS}


def test_the_tested_n_are_the_tests():
    cpu_ns = test_attention.test_matches_unsharded_attention_float32.pytestmark
    ns = next(m.args[1] for m in cpu_ns if m.args[0] == "n")
    assert _matrix()["tested"][0] == "CPU, R = " + ", ".join(map(str, ns))
    assert test_gpu_attention.test_layer_n1_device_protocol
    assert _matrix()["tested"][1].startswith("one H200, R = 1 ")
    shared = next(m.args[1] for m in test_gpu_attention.test_layer_ranks_sharing_one_gpu.pytestmark)
    assert _matrix()["tested"][2].startswith("one H200, R = " + ", ".join(map(str, shared)) + " ")


def test_the_determinism_flag_is_the_gpu_tests():
    assert test_gpu_attention.DETERMINISTIC["XLA_FLAGS"] in _matrix()["same bits every run"][0]


def test_the_masks_tested_r_are_the_tests():
    """The one "tested" row stands for the documents-and-windows tests too: they run the same R on
    the CPU (first field of each case), and its GPU cells say where the masks ran."""
    cases = test_attention_masks.test_documents_match_unsharded_attention.pytestmark[0].args[1]
    cases += test_attention_masks.test_windows_match_unsharded_attention.pytestmark[0].args[1]
    ranks = sorted({case[0] for case in cases})
    assert _matrix()["tested"][0] == "CPU, R = " + ", ".join(map(str, ranks))
    assert all("masks" in cell for cell in _matrix()["tested"][1:])
