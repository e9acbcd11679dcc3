"""The benchmarks' names for peer-transport workspaces: "<protocol>[:B[:S]][+overlap]".

protocol is "auto", "device" or "memop"; B the SM budget and S the push share of the device
protocol; "+overlap" runs every call as a start/done pair on the workspace's own stream
(Workspace(overlap=True)).
"""

from __future__ import annotations


def workspace_options(name: str) -> dict:
    """cpg.Workspace keywords of one name, e.g. "device:32:0.5+overlap"."""
    base, plus, extra = name.partition("+")
    if plus and extra != "overlap":
        raise ValueError(f"unknown workspace option {extra!r} in {name!r} (only '+overlap')")
    protocol, *tuning = base.split(":")
    if protocol not in ("auto", "device", "memop") or len(tuning) > 2:
        raise ValueError(f"workspace name {name!r}: want <auto|device|memop>[:B[:S]][+overlap]")
    options: dict = {"protocol": protocol}
    if tuning:
        options["sm_budget"] = int(tuning[0])
    if len(tuning) > 1:
        options["push_share"] = float(tuning[1])
    if plus:
        options["overlap"] = True
    return options
