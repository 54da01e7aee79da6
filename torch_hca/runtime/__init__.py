"""The runtime: the device mesh, rank-to-rank exchange over the store, and launching ranks.

Imports only the algebra (`torch_hca.spmd`) and the base (`errors`, `_torch_private`)."""
