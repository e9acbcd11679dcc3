"""masks_checkpoint_policy on its own: it saves what carries the masks' name, and leaves every
other value to the policy it is given, offloading ones included (jax's save_from_both_policies
refuses those). The layer under it: test_mosaic_layer.py and test_attention_masks.py."""

import contextlib
import io

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import jax_cpgrad as cpg


def _saved(policy) -> list[str]:
    def f(a):
        b = checkpoint_name(jnp.sin(a), "model")
        c = checkpoint_name(jnp.cos(b), cpg.MASKS_CHECKPOINT_NAME)
        return jnp.sum(jnp.sin(c) * jnp.exp(b))

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # jax's one public listing of them prints it
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(f, policy=policy), jnp.ones(3))
    return printed.getvalue().splitlines()


def test_the_policy_saves_the_masks_alone():
    saved = _saved(cpg.masks_checkpoint_policy())
    assert any("named 'jax_cpgrad_masks'" in s for s in saved), saved
    assert not any("named 'model'" in s for s in saved), saved


def test_the_policy_joins_the_models_own():
    saved = _saved(cpg.masks_checkpoint_policy(jax.checkpoint_policies.save_only_these_names("model")))
    assert any("named 'jax_cpgrad_masks'" in s for s in saved), saved
    assert any("named 'model'" in s for s in saved), saved


def test_the_policy_joins_an_offloading_policy():
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["model"],
        offload_src="device", offload_dst="pinned_host",
    )  # fmt: skip
    saved = _saved(cpg.masks_checkpoint_policy(offload))
    assert any("named 'jax_cpgrad_masks'" in s for s in saved), saved
    assert any("device_put" in s for s in saved), saved  # "model", offloaded to the host
