"""Checks of what the compiler emits: ranks agree on inputs (`agreement`), the physical program
refines the logical one (`refinement`), ranks issue the same collectives (`spmd_check`), a
reordered schedule is equivalent (`schedule_check`)."""
