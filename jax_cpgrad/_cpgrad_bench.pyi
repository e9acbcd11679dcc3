"""Types of the optional benchmark module (ffi/bench/)."""

from typing import Any

def kernel_bench(
    n: int, tensors: int, global_bytes: int, dtype: str, iters: int = 20, reps: int = 7
) -> dict[str, Any]: ...
def call_overhead_bench(
    n: int, global_bytes: int = 4096, iters: int = 2000, block_budget: int = 64, push_blocks: int = 32
) -> dict[str, Any]: ...
def copy_bench(src: int, dst: int, bytes: int, iters: int = 20, reps: int = 7) -> dict[str, Any]: ...
def push_bandwidth(
    members: list[tuple[int, list[int]]],
    bytes_per_peer: int,
    iters: int = 10,
    reps: int = 5,
    engine: str = "sm",
) -> dict[str, Any]: ...
def chain_bench(
    devices: list[int],
    op: str = "grad_return",
    global_bytes: int = 65536,
    calls: int = 200,
    reps: int = 7,
    block_budget: int = 132,
    push_blocks: int = 66,
    kernel: str = "fused",
    graph: bool = True,
    shape: list[int] = [],
    wire: str = "auto",
) -> dict[str, Any]: ...
def launch_shape(
    op: str,
    n: int,
    tensors: int,
    outer: int,
    run: int,
    element_bytes: int,
    block_budget: int = 132,
    push_blocks: int = 66,
) -> dict[str, int]: ...
