"""One line per unit of long work, with the time since the work began, on stderr.

``python -m torch_hca bench`` and ``demo`` run for seconds to minutes; these
lines say what they are doing. They go to stderr so that what a command prints
on stdout (tables, JSON) stays clean to redirect::

    [bench 0.0s] starting 2 local gloo ranks
    [bench 4.1s] lm: single-device reference
    [bench 12.3s] lm: hca ...
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``Progress("bench")("lm: hca ...")`` prints ``[bench 12.3s] lm: hca ...`` to stderr.

    ``since``: the `time.time()` the work began. Ranks are separate processes:
    given their launcher's, every rank counts from the same moment.
    ``enabled=False`` prints nothing (ranks other than 0, say).
    """

    def __init__(self, command: str, since: float | None = None, enabled: bool = True, stream: TextIO | None = None):
        self.command = command
        self.since = time.time() if since is None else since
        self.enabled = enabled
        self.stream = stream  # None: sys.stderr at the time of each line (so redirections apply)

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        stream = self.stream if self.stream is not None else sys.stderr
        print(f"[{self.command} {time.time() - self.since:.1f}s] {message}", file=stream, flush=True)
