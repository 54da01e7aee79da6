"""Seeded corruptions of a strategy file cut by uneven shares, for tests/test_verify.py's catch rate.

Each takes the file (a dict, mutated in place) and a `random.Random`, and returns the rule that
must catch it, or None where the file has nothing of the kind (a file without shares).
"""

from __future__ import annotations


def _cut(d):
    """The first graph cut by shares, or None."""
    return next((g for g in d["graphs"] if g.get("shares")), None)


def wrong_share_weight(d, rng):
    """A rank's weight that is not its share of the rows: a scaled reduction weighted wrong."""
    g = _cut(d)
    if g is None:
        return None
    w = g["shares"]["weights"]
    w[rng.randrange(len(w))] += 0.125
    return "share weights"


def shares_that_do_not_fit(d, rng):
    """One share more or less than the ranks of its mesh dim."""
    g = _cut(d)
    if g is None:
        return None
    s = g["shares"]["shares"]
    if rng.random() < 0.5 and len(s) > 1:
        s.pop()
    else:
        s.append(rng.randint(1, 4))
    return "shares"


def unweighted_mean_returned(d, rng):
    """An output that reads a weighted mean's unweighted value: each rank's mean counted alike."""
    g = _cut(d)
    if g is None or not g["shares"]["weighted_means"]:
        return None
    mean = rng.choice(g["shares"]["weighted_means"])
    summed = [n for n, v in g["values"].items() if mean in v.get("reads", [])]
    outs = [o for o in g["outputs"] if o["value"] in summed]
    if not outs:
        return None
    rng.choice(outs)["value"] = mean
    return "shares: weighted means"


def parameter_split_over_shares(d, rng):
    """A parameter stored split over the dim the shares cut (the model section, re-digested)."""
    g = _cut(d)
    if g is None:
        return None
    import hashlib
    import json

    model = d["model"]
    name = rng.choice(sorted(model["parameters"]))
    model["parameters"][name]["placements"][g["shares"]["mesh_dim"]] = "S(0)"
    body = {k: v for k, v in model.items() if k != "digest"}
    model["digest"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]
    return "shares: parameters whole"


def forward_gather_over_shares(d, rng):
    """A forward collective over the uneven dim that gathers instead of summing."""
    g = _cut(d)
    if g is None:
        return None
    fw = [c for c in g["collectives"] if c["direction"] == "forward" and c["mesh_dim"] == g["shares"]["mesh_dim"]]
    if not fw:
        return None
    rng.choice(fw)["kind"] = "all_gather"
    return "shares: forward sums"


def symbolic_bytes_off(d, rng):
    """A residual whose symbolic bytes are off by a constant: caught at the sample sizes."""
    g = _cut(d)
    symbolic = [r for r in (g or {}).get("residuals", []) if isinstance(r["bytes"], str)]
    if not symbolic:
        return None
    rng.choice(symbolic)["bytes"] += f" + {4 * rng.randint(1, 8)}"
    return "residual bytes"


MUTATIONS = [
    wrong_share_weight,
    shares_that_do_not_fit,
    unweighted_mean_returned,
    parameter_split_over_shares,
    forward_gather_over_shares,
    symbolic_bytes_off,
]
