"""torch_hca.passes (installed from the repository's top-level `passes/`)."""

if __name__ != "torch_hca.passes":
    raise ImportError(
        "import this package as torch_hca.passes (install the project with "
        "`pip install -e .`); importing the bare `passes` would load a second copy"
    )
