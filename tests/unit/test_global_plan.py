"""The global save planner, fed simulated ranks' local plans (no processes)."""

from __future__ import annotations

import math

import pytest

from tardigrade import InvalidArgumentError
from tardigrade._plan import (
    _NBYTES,
    PER_RANK,
    REPLICATED,
    SHARDED,
    LocalEntry,
    LocalPlan,
    global_plan,
    global_plan_from_wire,
)
from tardigrade._sharding import Box
from tardigrade._write import WrittenFile, manifest_doc, seal_checked
from tardigrade.format.checksum import ALGORITHM
from tardigrade.format.manifest import COLUMNAR_VERSION, parse

MiB = 1024 * 1024


def rows_plan(world: int, rank: int, rows: int, cols: int, name: str = "emb") -> LocalEntry:
    lo, hi = round(rank * rows / world), round((rank + 1) * rows / world)
    return LocalEntry("F32", (hi - lo, cols), False, Box((lo, 0), (rows, cols)), name)


def items_by_rank(g):  # type: ignore[no-untyped-def]
    return [[it for f in p.files for it in f.items] for p in g.ranks]


def test_replicated_tensors_are_written_once_and_balanced_by_bytes() -> None:
    shared = tuple(LocalEntry("F32", (1024, 1024), False, None, f"w{i}") for i in range(6))
    plans = [LocalPlan(shared, ()) for _ in range(4)]
    g = global_plan(plans)
    assert all(t.layout == REPLICATED for t in g.tensors)
    written = [sum(it.nbytes for it in items) for items in items_by_rank(g)]
    assert sum(written) == 6 * 4 * MiB  # one copy in total
    assert max(written) - min(written) <= 16 * MiB  # within one chunk of each other
    again = global_plan(plans)  # deterministic
    assert again.to_wire() == g.to_wire() and again.ranks == g.ranks


def test_sharded_pieces_each_written_by_one_holder() -> None:
    # A 2x2 mesh with the tensor sharded on dim 0 over mesh dim 0 and replicated over mesh
    # dim 1: ranks (0, 1) hold the top half, ranks (2, 3) the bottom half.
    def entry(rank: int) -> LocalEntry:
        lo = 0 if rank < 2 else 5
        return LocalEntry("F32", (5 if rank < 2 else 4, 3), False, Box((lo, 0), (9, 3)), "w")

    g = global_plan([LocalPlan((entry(r),), ()) for r in range(4)])
    assert g.tensors[0].layout == SHARDED and g.tensors[0].shape == (9, 3)
    owners = {it.offsets: r for r, items in enumerate(items_by_rank(g)) for it in items}
    assert set(owners) == {(0, 0), (5, 0)}
    assert owners[(0, 0)] in (0, 1) and owners[(5, 0)] in (2, 3)


@pytest.mark.parametrize(
    ("boxes", "what"),
    [
        ([((0, 0), (6, 3)), ((5, 0), (5, 3))], "overlap"),
        ([((0, 0), (4, 3)), ((5, 0), (5, 3))], "gap"),
    ],
)
def test_pieces_that_do_not_tile_the_tensor_are_refused_naming_the_key(
    boxes: list[tuple[tuple[int, int], tuple[int, int]]], what: str
) -> None:
    plans = [
        LocalPlan((LocalEntry("F32", shape, False, Box(off, (10, 3)), "model.emb"),), ())
        for off, shape in boxes
    ]
    with pytest.raises(InvalidArgumentError, match=r"state\['model.emb'\].*exactly once"):
        global_plan(plans)


def test_ranks_holding_other_tensors_are_refused() -> None:
    a = LocalPlan((LocalEntry("F32", (4,), False, None, "w"),), ())
    b = LocalPlan((LocalEntry("F16", (4,), False, None, "w"),), ())
    with pytest.raises(InvalidArgumentError, match="rank 1 saves other tensors than rank 0"):
        global_plan([a, b])


def test_per_rank_tensors_belong_to_their_rank() -> None:
    plans = [LocalPlan((), (LocalEntry("I64", (r + 1,), False, None, "rng"),)) for r in range(3)]
    g = global_plan(plans)
    assert [t.layout for t in g.tensors] == [PER_RANK] * 3
    assert [t.rank for t in g.tensors] == [0, 1, 2]
    assert g.own_base == (0, 1, 2)
    for r, items in enumerate(items_by_rank(g)):
        assert [it.tensor for it in items] == [r]
        assert items[0].entry == 0  # the rank's own first local entry


def test_the_wire_form_plans_like_the_objects() -> None:
    plans = [
        LocalPlan(
            (rows_plan(3, r, 100, 8), LocalEntry("F32", (7,), False, None, "b")),
            (LocalEntry("I64", (2,), False, None, "pos"),),
        )
        for r in range(3)
    ]
    wire = [p.to_bytes(full=r == 0) for r, p in enumerate(plans)]
    a, b = global_plan_from_wire(wire), global_plan(plans)
    assert a.to_wire() == b.to_wire() and a.ranks == b.ranks and a.tensors == b.tensors
    # Non-coordinator payloads carry no JSON per shared tensor: only packed pieces.
    assert len(wire[1]) < len(wire[0])


def test_single_process_layout_is_unchanged() -> None:
    shared = (LocalEntry("F32", (10,), False, None, "a"), LocalEntry("F64", (), False, None, "b"))
    (plan,) = global_plan([LocalPlan(shared, ())]).ranks
    assert [f.name for f in plan.files] == ["data-00000-of-00001.safetensors"]
    assert [(it.key, it.offsets, it.shape) for it in plan.files[0].items] == [
        ("b", (), ()),
        ("a", (0,), (10,)),
    ]


def test_coordinator_work_and_plan_size_grow_linearly_with_ranks() -> None:
    """A scaled-down run of the 1,024-rank simulation in bench/plan_scale.py."""

    def items(world: int) -> int:
        wire = [
            LocalPlan(
                tuple(rows_plan(world, r, 64 * world, 16, f"t{i}") for i in range(50)), ()
            ).to_bytes(full=r == 0)
            for r in range(world)
        ]
        g = global_plan_from_wire(wire)
        return sum(len(f.items) for p in g.ranks for f in p.files)

    small, big = items(16), items(64)
    assert small == 16 * 50 and big == 64 * 50
    assert math.isclose(big / small, 4)


def coordinator_manifest(world: int, tensors: int = 40) -> bytes:
    """The manifest a coordinator commits for ``world`` simulated ranks (half the tensors
    row-sharded over every rank), as checked before a commit."""
    wire = [
        LocalPlan(
            tuple(
                rows_plan(world, r, 64 * world, 16, f"w{i}")
                if i % 2 == 0
                else LocalEntry("F32", (16,), False, None, f"b{i}")
                for i in range(tensors)
            ),
            (LocalEntry("I64", (4,), False, None, "rng"),),
        ).to_bytes(full=r == 0)
        for r in range(world)
    ]
    g = global_plan_from_wire(wire)
    written = {
        name: WrittenFile(size, "0" * 16, "0123456789abcdef" * len(rows))
        for name, rows in zip(g.files, g.file_rows, strict=True)
        for size in [int(g.table[rows, _NBYTES].sum())]  # the file's tensor bytes
    }
    header = {"format": "tardigrade", "format_version": 4, "world_size": world,
              "checksum_algorithm": ALGORITHM, "step": None, "epoch": None}  # fmt: skip
    doc = manifest_doc(
        header, {"t": "dict", "v": []}, [[] for _ in range(world)], g, written, packed=False
    )
    return seal_checked(doc, "simulated")


def test_a_distributed_manifest_is_columns_and_grows_linearly_with_ranks() -> None:
    s16, s32, big = (coordinator_manifest(w) for w in (16, 32, 64))
    m = parse(big, "simulated")
    assert m.raw["format_version"] == COLUMNAR_VERSION
    w0 = m.tensors[0]
    assert m.raw["tensors"][0]["chunks"]["shape"] == [64, 16]  # one number: every chunk's
    assert [c.offsets for c in w0.chunks] == [(64 * r, 0) for r in range(64)]
    assert [c.file[:11] for c in w0.chunks] == [f"data-r{r:05d}" for r in range(64)]
    # Linear: each rank adds about as many bytes as the last (its numbers' digits aside).
    assert 1.9 <= (len(big) - len(s32)) / (len(s32) - len(s16)) <= 2.2
    assert len(big) / len(s16) <= 4


def test_replicated_tensors_go_only_to_ranks_that_staged_them() -> None:
    shared = tuple(LocalEntry("F32", (1024, 1024), False, None, f"w{i}") for i in range(6))
    # An async save staged on each rank only what its last plan gave it: rank 0 lacks w0-w2,
    # rank 1 lacks w3, rank 2 lacks nothing (its layout changed, so it staged everything).
    plans = [LocalPlan(shared, (), (0, 1, 2)), LocalPlan(shared, (), (3,)), LocalPlan(shared, ())]
    g = global_plan(plans)
    for r, items in enumerate(items_by_rank(g)):
        assert not {it.entry for it in items} & set(plans[r].unstaged), r
    assert sum(it.nbytes for items in items_by_rank(g) for it in items) == 6 * 4 * MiB
    wire = [p.to_bytes(full=r == 0) for r, p in enumerate(plans)]
    assert global_plan_from_wire(wire).to_wire() == g.to_wire()
    # The plan cache compares layouts: what a rank staged is not part of its signature.
    assert plans[0].signature() == LocalPlan(shared, ()).signature()


def test_a_replicated_tensor_no_rank_staged_is_refused_naming_it() -> None:
    shared = (LocalEntry("F32", (4,), False, None, "model.w"),)
    with pytest.raises(InvalidArgumentError, match=r"state\['model.w'\]: no rank staged"):
        global_plan([LocalPlan(shared, (), (0,)), LocalPlan(shared, (), (0,))])
