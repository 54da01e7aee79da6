"""The compiler's brain: the logical program, lifting it onto layouts, the layout choice, and the checks.

Rooms inside: `layout/` (strategies per op and the solver over them), `checks/` (input agreement,
refinement, SPMD and schedule checks)."""
