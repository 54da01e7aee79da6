"""The layout choice: each op's candidate strategies (`candidates`) and the global solver (`solver`)."""
