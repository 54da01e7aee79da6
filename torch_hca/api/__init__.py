"""The user API: `sharded` and `plan`, collectives and gradients, `step`, checkpoints, calibration.

`torch_hca/__init__.py` re-exports the public names; import them from `torch_hca`."""
