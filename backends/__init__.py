"""torch_hca.backends (installed from the repository's top-level `backends/`)."""

if __name__ != "torch_hca.backends":
    raise ImportError(
        "import this package as torch_hca.backends (install the project with "
        "`pip install -e .`); importing the bare `backends` would load a second copy"
    )
