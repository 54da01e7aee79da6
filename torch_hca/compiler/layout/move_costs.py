"""What the layout solver prices: the collectives a move between two layouts issues on a mesh,
forward and in backward (its transposes, and the reductions a cotangent owes), under a cost model.

`Costs` is one mesh and one `CostModel`; `torch_hca.compiler.layout.solver` charges each edge and
value of the program with it. Moves of parameters are bucketed: they pay bandwidth, and their bucket
(direction, kind, mesh dim) pays its latency once.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from torch_hca.compiler.layout.candidates import Layout, split_factor
from torch_hca.spmd.collective_kinds import Kind, cotangent_letter, move_kind
from torch_hca.spmd.cost_model import CostModel, all_to_all_runs_as_all_gather
from torch_hca.spmd.placements import letter


class Costs:
    """Edge and value costs on one mesh, for one cost model."""

    def __init__(self, mesh: DeviceMesh, model: CostModel):
        self.mesh = mesh
        self.model = model
        self.sizes = tuple(mesh.shape)

    def payload(self, nbytes: float, a: Layout, b: Layout, m: int) -> float:
        """Bytes of the tensor one group of mesh dimension `m` works on."""
        other = 1
        for k, n in enumerate(self.sizes):
            if k != m:
                other *= max(split_factor(a[k], n), split_factor(b[k], n))
        return nbytes / other

    def collective(self, kind: Kind, payload: float, n: int, bucket: tuple | None, used: dict | None) -> float:
        """One collective's seconds; a bucketed one pays bandwidth and notes its bucket in `used`.

        `used` is a dict used as an insertion-ordered set: the integer program's variables are
        made in its order, which must not depend on the hash seed (it differs per rank, and a
        bucket holds a `Kind`, whose hash is its name's), or ranks may break ties differently.
        """
        if kind is Kind.ALL_TO_ALL:  # `payload` is the whole value's; an all_to_all sends from its piece
            as_gather = all_to_all_runs_as_all_gather(self.mesh.device_type)
            kind, payload = (Kind.ALL_GATHER, payload) if as_gather else (kind, payload / n)
        if bucket is None:
            return self.model.collective_s(kind, payload, n)
        if used is not None and self.model.bandwidth_s(kind, payload, n) > 0:
            used[bucket] = None
        return self.model.bandwidth_s(kind, payload, n)

    def bucket_latency(self, bucket: tuple) -> float:
        """The latency one bucket (direction, kind, mesh dim) pays once."""
        _, kind, m = bucket
        return self.model.collective_s(kind, 0, self.sizes[m])

    def forward(
        self, nbytes: float, src: Layout, dst: Layout, bucketed: bool = False, used: dict | None = None
    ) -> float:
        total = 0.0
        for m, n in enumerate(self.sizes):
            kind = move_kind(letter(src[m]), letter(dst[m]))
            if kind is not None:
                bucket = ("forward", kind, m) if bucketed else None
                total += self.collective(kind, self.payload(nbytes, src, dst, m), n, bucket, used)
        return total

    def backward(
        self,
        nbytes: float,
        src: Layout,
        dst: Layout,
        varying: tuple[bool, ...],
        bucketed: bool = False,
        used: dict | None = None,
    ) -> tuple[float, list[int]]:
        """Transposes of the move src -> dst, and the mesh dims whose reduction the value owes."""
        total, owed = 0.0, []
        for m, n in enumerate(self.sizes):
            arrives, needed = cotangent_letter(dst[m], varying[m]), cotangent_letter(src[m])
            if isinstance(src[m], Replicate) and isinstance(dst[m], Replicate):
                if arrives == "P":
                    owed.append(m)  # summed over consumers first, reduced once (see `reduction`)
                continue
            kind = move_kind(arrives, needed)
            if kind is not None:
                bucket = ("backward", kind, m) if bucketed else None
                total += self.collective(kind, self.payload(nbytes, src, dst, m), n, bucket, used)
        return total, owed

    def reduction(
        self, nbytes: float, layout: Layout, m: int, bucketed: bool = False, used: dict | None = None
    ) -> float:
        bucket = ("backward", Kind.ALL_REDUCE, m) if bucketed else None
        return self.collective(Kind.ALL_REDUCE, self.payload(nbytes, layout, layout, m), self.sizes[m], bucket, used)
