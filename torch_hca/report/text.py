"""The report's text for people: FX code that fits a line width (`readable_code`), aligned
tables whose free-text column wraps, the names people write (``fc2.bias``, ``blocks.0.attn``),
and the line on what layout="tune" timed."""

from __future__ import annotations

import re
import textwrap
from typing import Any

WIDTH = 120  # the widest line str(report), table(WIDTH) and the demo print


def readable_code(code: str, width: int = WIDTH) -> str:
    """FX code with no line wider than ``width``, for people (``dtensor_code`` stays as FX wrote it).

    A statement's trailing ``;  a = b = None`` (where FX lets values go) gets its
    own line; a long call, signature or tuple puts one item per line::

        def forward(
            self,
            L_self_modules_fc1_parameters_weight_ : torch.distributed.tensor.DTensor,
            ...
        ):
    """
    out: list[str] = []
    for line in code.strip("\n").splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        for statement in _top_level(line.strip(), ";"):
            if statement.strip():
                out += _fit(indent + statement.strip(), width)
    return "\n".join(out)


def _scan(text: str):
    """(index, character, bracket depth before it) for each character outside string literals."""
    depth, quote = 0, None
    for i, ch in enumerate(text):
        if quote is not None:
            if ch == quote and text[i - 1] != "\\":
                quote = None
        elif ch in "'\"":
            quote = ch
        else:
            yield i, ch, depth
            depth += (ch in "([{") - (ch in ")]}")


def _top_level(text: str, sep: str) -> list[str]:
    """``text`` cut at each ``sep`` outside brackets and strings."""
    cuts = [i for i, ch, depth in _scan(text) if ch == sep and depth == 0]
    return [text[a + 1 : b] for a, b in zip([-1, *cuts], [*cuts, len(text)])]


def _fit(line: str, width: int) -> list[str]:
    """One line of code as lines of at most ``width``: the first bracket's items one per line, else wrapped."""
    if len(line) <= width:
        return [line]
    indent = line[: len(line) - len(line.lstrip())]
    scanned = list(_scan(line))
    opening = next(((i, depth) for i, ch, depth in scanned if ch in "([{"), None)
    end = (
        None
        if opening is None
        else next((i for i, ch, depth in scanned if i > opening[0] and ch in ")]}" and depth == opening[1] + 1), None)
    )
    if end is None:  # no brackets (`a = b = None`): cut at spaces, continued with a backslash
        cut = textwrap.wrap(
            line.strip(), width - 2, initial_indent=indent, subsequent_indent=indent + " " * 8, break_on_hyphens=False
        )
        return [piece + " \\" for piece in cut[:-1]] + cut[-1:]
    start = opening[0]
    inner = line[start + 1 : end]
    items = [item.strip() for item in _top_level(inner, ",") if item.strip()]
    comma = "," if len(items) > 1 or inner.rstrip().endswith(",") else ""  # (x,) stays a tuple
    lines = _fit(line[: start + 1], width)
    for item in items:
        lines += _fit(f"{indent}    {item}{comma}", width)
    return lines + _fit(indent + line[end:], width)


def bytes_text(n) -> str:
    """A byte count as the table prints it; under dynamic shapes a symbolic one (``128*s33``) as its expression."""
    return f"{n:.0f}" if isinstance(n, (int, float)) else str(n)


def tuning_line(tuning: dict[str, Any]) -> str:
    """One line: the candidates layout="tune" timed, the one kept first."""
    failed = "".join(f"; not compiled: {f}" for f in tuning.get("failed", []))
    if len(tuning["candidates"]) == 1:
        return f"tuned: one program to run ({tuning['candidates'][0]['layout']}), nothing timed{failed}"
    times = ", ".join(
        f"{c['layout']} {c['median_s'] * 1e3:.2f} ms"
        + ("" if c["predicted_s"] is None else f" (predicted {c['predicted_s'] * 1e3:.2f})")
        for c in tuning["candidates"]
    )
    return (
        f"tuned: kept {tuning['kept']} of {len(tuning['candidates'])} distinct layouts, by the slowest rank's "
        f"median of {tuning['rounds']} forward + backward runs on the first call's inputs: {times}{failed}"
    )


def aligned(rows: list[tuple[str, ...]], width: int | None) -> str:
    """Rows as aligned columns; given ``width``, a row wider than it wraps its last (free text) column."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        line = "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
        lines += [line] if width is None or len(line) <= width else _wrap_last_column(r, widths, width)
    return "\n".join(lines)


def mesh_dims_named(kinds: str, names: list[str]) -> str:
    """``"all_gather@0"`` -> ``"all_gather@dp"`` where the mesh names its dims."""
    return re.sub(r"@(\d+)", lambda m: "@" + (names[int(m[1])] if int(m[1]) < len(names) else m[1]), kinds or "")


def dotted(name: str) -> str:
    """Dynamo's name of a module attribute as people write it: ``l_self_modules_fc2_parameters_bias_`` -> ``fc2.bias``."""
    if not name.startswith("l_self_"):
        return name
    path = name[len("l_self_") :].rstrip("_")
    for kind in ("modules", "parameters", "buffers"):  # "<kind>_" opens each step of the path
        path = re.sub(rf"(^|_){kind}_", lambda m: "." if m.group(1) else "", path)
    return path


_GETATTR = re.compile(r"getattr\(([^(),]*), '([^']*)'\)")
_SUBSCRIPT = re.compile(r"\[['\"]([^'\"]*)['\"]\]")
# Steps of a Dynamo source that are no step of the module path a user writes.
_NOT_A_STEP = {"__dict__", "_modules", "_parameters", "_buffers"}


def module_path(source: str) -> str:
    """Dynamo's source of a submodule or parameter as people write it.

    ``getattr(L['self'].__dict__['_hca_logical'].inner.blocks, '0').attn.wq`` -> ``blocks.0.attn.wq``,
    ``L['self']._modules['fc1']`` -> ``fc1``; the root module itself is ``""``. Text that is no
    such source comes back unchanged.
    """
    if not source.startswith(("L[", "getattr(")):
        return source
    path = source
    while True:  # getattr(x, 'k') -> x.k, innermost first
        shorter = _GETATTR.sub(r"\1.\2", path)
        if shorter == path:
            break
        path = shorter
    path = _SUBSCRIPT.sub(r".\1", path)  # x['k'] -> x.k
    steps = [s for s in path.split(".") if s and s not in _NOT_A_STEP]
    if steps[:2] == ["L", "self"] or steps[:1] == ["L"]:
        steps = steps[2:] if steps[1:2] == ["self"] else steps[1:]
    if "_hca_logical" in steps:  # hca.sharded's holder of the user's module (torch_hca.compiler.logical)
        steps = steps[steps.index("_hca_logical") + 1 :]
        steps = steps[1:] if steps[:1] == ["inner"] else steps
    return ".".join(steps)


def _wrap_last_column(row: tuple[str, ...], widths: list[int], width: int) -> list[str]:
    """A table row whose last column (free text) wraps within the column, or below the row if it is too narrow."""
    prefix = "  ".join(v.ljust(w) for v, w in zip(row[:-1], widths[:-1])) + "  "
    room = width - len(prefix)
    if room >= 30:
        text = _at_most(textwrap.wrap(row[-1], room, break_on_hyphens=False), room)
        return [prefix + text[0]] + [" " * len(prefix) + t for t in text[1:]]
    head = textwrap.wrap(prefix.rstrip(), width, subsequent_indent="    ")
    return head + _at_most(
        textwrap.wrap(row[-1], width, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False), width
    )


CELL_LINES = 3  # a wrapped cell's most lines; the whole text is in to_json() and debug_dir's collectives.txt


def _at_most(lines: list[str], width: int, most: int = CELL_LINES) -> list[str]:
    """A wrapped cell cut to `most` lines, the last ending in ``...`` when text was left out."""
    if len(lines) <= most:
        return lines
    last = lines[most - 1]
    return lines[: most - 1] + [(last if len(last) <= width - 3 else last[: width - 3].rstrip()) + "..."]
