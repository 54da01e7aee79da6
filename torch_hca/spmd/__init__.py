"""The SPMD algebra the compiler is built on, importing nothing above it.

* `placements`: how a placement, a layout and a dtype are written, one way (R, P(sum), S(d); R, P, S<d> in the move table).
* `collective_kinds`: the table of collective kinds: placements, transposes,
  emitters, wire bytes, and the move table (what a move on one mesh dimension
  issues forward and may issue backward).
* `collective_nodes`: the reader of collective nodes (by op schema): kind,
  group, payload and its bytes; the dispatcher-side counter.
* `events`: the graph facts the schedule pass reads (collective starts and waits, views, writes, late nodes).
* `op_families`: the op-family table (views, matmuls, FLOPs), keyed by op objects.
* `cost_model`: seconds per collective and per FLOP, calibrated per machine.

Only `torch_hca.errors` and `torch_hca._torch_private` sit below it
(tests/test_layering.py).
"""
