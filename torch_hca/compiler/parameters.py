"""The parameter registry: which module `hca.sharded` distributed each parameter of, and its name.

The backend, the passes and the report name the parameters a compiled graph reads through this
registry; `hca.sharded` (torch_hca.api.plan) registers each module it distributes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

# Every module `hca.sharded` distributed (held weakly) -> {id(parameter): qualified
# name}, a cache rebuilt from the module on a miss: lets the backend and the report
# name the parameters a compiled graph reads. Names and roles live on the module
# (its parameters and its ShardingSpec), never on a reference to a parameter: a weak
# reference to a tensor makes `torch.utils.swap_tensors` refuse it, and `.to(dtype)`,
# `.double()`, `.to("cpu")`, `.to_empty()` swap a DTensor parameter's contents into
# the same Parameter object (so its identity, and this cache, survive them).
_SHARDED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _owner(t: Any) -> tuple[nn.Module, str] | None:
    """(the sharded module, qualified name) of a parameter of a sharded module, else None."""
    if not isinstance(t, nn.Parameter):  # also true of a DTensor parameter
        return None
    for rebuild in (False, True):  # a parameter replaced since the cache was built: rebuild once
        for module, names in list(_SHARDED.items()):
            if rebuild:
                names = _SHARDED[module] = {id(p): n for n, p in module.named_parameters()}
            name = names.get(id(t))
            if name is not None and _get_parameter(module, name) is t:
                return module, name
    return None


def _parameter_info(t: Any) -> tuple[str, str] | None:
    """(qualified name, gradient role) of a parameter of a sharded module, else None."""
    owner = _owner(t)
    if owner is None:
        return None
    module, name = owner
    spec = module.__dict__.get("_hca_spec")
    return name, spec.grad_roles.get(name, "eager") if spec is not None else "eager"


def parameter_module(t: torch.Tensor) -> nn.Module | None:
    """The module `hca.sharded` distributed parameter `t` of, else None."""
    owner = _owner(t)
    return owner[0] if owner else None


def _get_parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


def parameter_name(t: torch.Tensor) -> str | None:
    """The qualified name of a parameter sharded by `hca.sharded`, else None."""
    info = _parameter_info(t)
    return info[0] if info else None


def parameter_role(t: torch.Tensor) -> str | None:
    """The gradient role ("eager" or "deferred") of a sharded parameter, else None."""
    info = _parameter_info(t)
    return info[1] if info else None


def register_sharded(module: nn.Module) -> None:
    """Remember `module` (weakly) as one `hca.sharded` distributed; its names are read lazily."""
    _SHARDED[module] = {}
