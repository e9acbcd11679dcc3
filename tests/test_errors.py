"""Bad input is a ValueError at trace time that names the problem."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_cpgrad as cpg
from spmd import cp_mesh as _mesh, place
from workspace_stub import workspace_spec

cp_mesh = lambda n: _mesh(n, "cpu")


def _trace(n, fn, *arrays):
    mesh = cp_mesh(n)
    f = jax.jit(
        jax.shard_map(
            lambda *xs: jax.tree.map(lambda o: o[None], fn(*(x[0] for x in xs))),
            mesh=mesh,
            in_specs=P("cp"),
            out_specs=P("cp"),
        )
    )
    return f(*(place(mesh, a) for a in arrays))


def z(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


@pytest.mark.parametrize(
    "fn,arrays,match",
    [
        (
            lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=1),
            [z(2, 2, 10, 3)],
            "global sequence length 10 .* multiple of 4",
        ),
        (
            lambda a: cpg.all_gather(a, axis_name="cp", seq_axis=1),
            [z(2, 2, 3, 3)],
            "local sequence length 3 .* multiple of 2",
        ),
        (
            lambda a, b: cpg.grad_return((a, b), axis_name="cp", seq_axis=1),
            [z(2, 2, 8, 3), z(2, 2, 8, 4)],
            "same shape and dtype",
        ),
        (
            lambda a, b: cpg.grad_return((a, b), axis_name="cp", seq_axis=1),
            [z(2, 2, 8, 3), z(2, 2, 8, 3, dtype=np.float16)],
            "same shape and dtype",
        ),
        (
            lambda a: cpg.grad_return(a, axis_name="tp", seq_axis=1),
            [z(2, 2, 8, 3)],
            "axis name 'tp' is not bound",
        ),
        (
            lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=3),
            [z(2, 2, 8, 3)],
            "seq_axis 3 is out of range",
        ),
        (
            lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=-4),
            [z(2, 2, 8, 3)],
            "seq_axis -4 is out of range",
        ),
        (
            lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=1),
            [z(2, 2, 8, 3, dtype=np.int32)],
            "dtype int32",
        ),
        (
            lambda a: cpg.all_gather(a, axis_name="cp", seq_axis=1),
            [z(2, 2, 8, 3, dtype=np.complex64)],
            "dtype complex64",
        ),
        (lambda a: cpg.grad_return((), axis_name="cp", seq_axis=1), [z(2, 2, 8, 3)], "empty tuple"),
        (
            lambda a: cpg.grad_return((a,) * 9, axis_name="cp", seq_axis=1),
            [z(2, 2, 8, 3)],
            "at most 8 arrays",
        ),
    ],
)
def test_bad_input_raises_value_error(fn, arrays, match):
    with pytest.raises(ValueError, match=match):
        _trace(2, fn, *arrays)


def test_outside_shard_map_is_a_clear_error():
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        cpg.grad_return(jnp.zeros((2, 8, 3)), axis_name="cp")


def test_workspace_needs_gpus():
    mesh = cp_mesh(2)
    with pytest.raises(ValueError, match="needs GPUs"):
        cpg.Workspace(mesh, "cp", nbytes=1024)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(axis_name="sp", nbytes=1024), "not an axis of the mesh"),
        (dict(axis_name="cp", nbytes=0), "nbytes must be a positive int"),
        (dict(axis_name="cp", nbytes=-5), "nbytes must be a positive int"),
        (dict(axis_name="cp", nbytes=1.5), "nbytes must be a positive int"),
    ],
)
def test_workspace_argument_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cpg.Workspace(cp_mesh(2), **kwargs)


@pytest.mark.parametrize(
    "fields,fn,match",
    [
        (
            dict(axis_name="sp"),
            lambda ws: lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=1, workspace=ws),
            "was created for axis 'sp'",
        ),
        (
            dict(num_ranks=4),
            lambda ws: lambda a: cpg.all_gather(a, axis_name="cp", seq_axis=1, workspace=ws),
            "has 2 devices but workspace 'stub' was created for 4",
        ),
        (
            dict(nbytes=64),
            lambda ws: lambda a: cpg.grad_return(a, axis_name="cp", seq_axis=1, workspace=ws),
            "moves 96 bytes per device .* holds 64",
        ),
    ],
)
def test_workspace_mismatches_raise_before_tracing_the_call(fields, fn, match):
    with pytest.raises(ValueError, match=match):
        _trace(2, fn(workspace_spec(**fields)), z(2, 2, 8, 3))


def test_a_workspace_description_names_its_protocol():
    with pytest.raises(ValueError, match="protocol must be one of"):
        workspace_spec(protocol="nccl")
    with pytest.raises(ValueError, match="overlap must be True or False"):
        workspace_spec(overlap="no")
    for reach in (-1, 2, True, 1.0):  # 2 ranks: 0 (all) or 1
        with pytest.raises(ValueError, match=r"reach must be an int in \[0, num_ranks\)"):
            workspace_spec(2).within(reach)
    assert workspace_spec(2).within(1).reach == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(protocol="fast"), "protocol must be 'auto', 'device' or 'memop'"),
        (dict(sm_budget=1), "sm_budget must be an int >= 2"),
        (dict(push_share=1.5), r"push_share must be in \(0, 1\]"),
        (dict(on_timeout="ignore"), "on_timeout must be 'raise' or 'abort'"),
        (dict(overlap="yes"), "overlap must be True or False"),
    ],
)
def test_workspace_option_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cpg.Workspace(cp_mesh(2), "cp", nbytes=1024, **kwargs)
