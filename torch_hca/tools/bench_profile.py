"""Where a bench step's time goes (``bench --profile``): one step under `torch.profiler`,
its Chrome trace split into compute, collectives, bucket copies and the rest."""

from __future__ import annotations

import json
from typing import Callable

from torch.profiler import ProfilerActivity, profile, record_function

# The step's label in the traces (docs/bench.md): a stable name, not this module's path.
STEP_MARKER = "torch_hca.bench.step"
BREAKDOWN = ("compute", "collectives", "bucket_copies", "other")
_COLLECTIVE_NS = ("c10d::", "_c10d_functional::", "c10d_functional::")
_OP_NS = ("aten::", "fsdp::", *_COLLECTIVE_NS)
# Copies that fill or empty a communication buffer when they sit next to a collective.
_COPY_OPS = frozenset(
    {
        "aten::cat",
        "aten::_chunk_cat",
        "aten::split",
        "aten::split_with_sizes",
        "aten::split_with_sizes_copy",
        "aten::copy_",
        "aten::_foreach_copy_",
        "aten::chunk",
        "aten::unbind",
        "aten::clone",
        "fsdp::all_gather_copy_in",
        "fsdp::split_with_sizes_copy",
    }
)
_VIEW_OPS = frozenset(
    {
        "aten::view",
        "aten::reshape",
        "aten::_unsafe_view",
        "aten::flatten",
        "aten::as_strided",
        "aten::narrow",
        "aten::slice",
        "aten::select",
        "aten::detach",
        "aten::alias",
        "aten::t",
    }
)
# Regions whose every op is bucket work: DDP's copies into and out of its buckets, FSDP2's copy-in/out.
_BUCKET_REGIONS = ("reducer::", "copy_in", "copy_out")


def traced_step(step: Callable[[], None], path: str) -> dict[str, float]:
    """Run `step` under torch.profiler, write its Chrome trace to `path`, return `step_breakdown`."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function(STEP_MARKER):
            step()
    prof.export_chrome_trace(path)
    with open(path) as f:
        return step_breakdown(json.load(f))


def _tree(events: list) -> list:
    """Nest complete events by time: [(event, children)], the roots in time order."""
    roots: list = []
    stack: list = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
            stack.pop()
        node = (e, [])
        (stack[-1][1] if stack else roots).append(node)
        stack.append(node)
    return roots


def _bucket_copies(siblings: list) -> set:
    """Copy ops in a run (views allowed) that touches a collective among `siblings`."""
    names = [e["name"] for e, _ in siblings]
    found = set()
    for i, name in enumerate(names):
        if not name.startswith(_COLLECTIVE_NS):
            continue
        for way in (range(i - 1, -1, -1), range(i + 1, len(names))):
            for j in way:
                if names[j] not in _COPY_OPS and names[j] not in _VIEW_OPS:
                    break
                found.add(j)
    return found


def _claim(siblings: list, totals: dict) -> None:
    """Add each event's time to its kind; what no op claims is left for `other`."""
    copies = _bucket_copies(siblings)
    for i, (e, children) in enumerate(siblings):
        name = e["name"]
        if name.startswith(_COLLECTIVE_NS):
            totals["collectives"] += e["dur"]
        elif i in copies or any(r in name for r in _BUCKET_REGIONS):
            totals["bucket_copies"] += e["dur"]
        else:
            # An op dispatched to a tensor subclass in Python (DTensor) is not compute itself.
            op = name.startswith(_OP_NS) and not any(c["name"] == "PythonSubclass" for c, _ in children)
            if op:
                totals["compute"] += e["dur"] - sum(c["dur"] for c, _ in children)
            _claim(children, totals)


def step_breakdown(trace: dict, marker: str = STEP_MARKER) -> dict[str, float]:
    """Seconds of the step marked `marker` in a Chrome trace, on the thread that ran it:

    compute        aten ops' own time (not their nested ops')
    collectives    c10d and functional-collective ops, waits included, with what they call
    bucket_copies  cat / split / copy_ next to a collective, DDP's and FSDP2's bucket regions
    other          the rest: Python, FX interpretation, Dynamo guards, autograd, and kernels
                   the profiler does not see as ops (Inductor's generated C++)
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    step = max((e for e in events if e["name"] == marker), key=lambda e: e["dur"])
    end = step["ts"] + step["dur"]
    inside = [
        e
        for e in events
        if e is not step and e["tid"] == step["tid"] and e["pid"] == step["pid"] and step["ts"] <= e["ts"] < end
    ]
    totals = dict.fromkeys(BREAKDOWN, 0.0)
    _claim(_tree(inside), totals)
    totals["other"] = max(step["dur"] - sum(totals.values()), 0.0)
    return {"step_s": step["dur"] * 1e-6, **{f"{k}_s": v * 1e-6 for k, v in totals.items()}}
