"""``tardigrade convert``: a torch.save file, a DCP directory or a safetensors folder imported
bit for bit; what it detects, refuses and reports."""

from __future__ import annotations

import argparse
import collections
import json
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import tardigrade as tg
from tardigrade.cli import main

from ..distributed._harness import run_ranks


def cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def dest() -> str:
    return f"memory://convert-{uuid.uuid4().hex[:12]}/ckpt"


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "fc.weight": torch.randn(8, 4, generator=g),
            "fc.bias": torch.randn(8, generator=g).to(torch.bfloat16),
            "embed": {"table": torch.randint(-100, 100, (5, 3), generator=g, dtype=torch.int64)},
        },
        "optim": {"state": {0: {"exp_avg": torch.randn(8, 4, generator=g)}}, "lr": 0.25},
        "step": 42,
        "name": "run-1",
        "history": [torch.arange(3), 7],
    }


def assert_same(a: Any, b: Any, where: str = "state", *, ordered: bool = True) -> None:
    """Equal trees, tensors bit for bit (dtype, shape and bytes); dict keys in the same order
    unless not ``ordered``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        raw_a, raw_b = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        assert torch.equal(raw_a, raw_b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        keys_a, keys_b = (list(d) if ordered else sorted(d, key=repr) for d in (a, b))
        assert keys_a == keys_b, f"{where}: {keys_a} != {keys_b}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}", ordered=ordered)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}", ordered=ordered)
    else:
        assert type(a) is type(b) and a == b, where


def test_torch_save_file_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "model.pt"
    original = state()
    torch.save(original, src)
    out = dest()
    rc, text, err = cli(capsys, "convert", src, out, "--step", 42)
    assert rc == 0, err
    assert text.startswith(f"converted {src} (torch) to {out}: 5 tensors")
    assert_same(original, tg.load(out))
    m = tg.read_manifest(out)
    assert m["step"] == 42
    assert m["metadata"]["converted_from"] == {"kind": "torch", "source": str(src)}


def test_legacy_torch_format_and_a_damaged_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = state()
    legacy = tmp_path / "legacy.pt"
    torch.save(original, legacy, _use_new_zipfile_serialization=False)  # not mapped: read
    out = dest()
    assert cli(capsys, "convert", legacy, out)[0] == 0
    assert_same(original, tg.load(out))
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(b"PK\x03\x04 then nothing a zip needs")
    rc, _, err = cli(capsys, "convert", damaged, dest())
    assert rc == 1
    assert f"{damaged}: not a torch.save file torch can read" in err


def test_an_ordered_dict_state_dict_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    src = tmp_path / "sd.pth"
    torch.save(module.state_dict(), src)
    out = dest()
    assert cli(capsys, "convert", src, out, "--from", "torch")[0] == 0
    loaded = tg.load(out)
    assert list(loaded) == list(module.state_dict())
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    fresh.load_state_dict(loaded)
    assert_same(dict(module.state_dict()), dict(fresh.state_dict()))


def test_dcp_directory_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp

    original = state()
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(original, checkpoint_id=str(src), no_dist=True)
    out = dest()
    rc, text, err = cli(capsys, "convert", src, out, "--json")
    assert rc == 0, err
    report = json.loads(text)
    assert report["kind"] == "dcp" and report["tensors"] == 5 and report["other_values"] == 4
    assert report["nbytes"] == 8 * 4 * 4 + 8 * 2 + 5 * 3 * 8 + 8 * 4 * 4 + 3 * 8
    # DCP stores keys as strings (its flattened names): optim.state.0 comes back as "0".
    original["optim"]["state"] = {"0": original["optim"]["state"][0]}
    assert_same(original, tg.load(out), ordered=False)


EMB = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3) * 0.5 - 2


def save_dcp_from_ranks(rank: int, world_size: int, path: str) -> bool:
    """Each rank saves its rows of ``EMB`` as a DTensor, and a replicated bias, with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {
        "model": {
            "emb": distribute_tensor(EMB, mesh, [Shard(0)]),
            "bias": distribute_tensor(torch.tensor([1.5, -3.0]), mesh, [Replicate()]),
        },
        "step": 9,
    }
    dcp.save(state, checkpoint_id=path)
    return True


@pytest.mark.slow  # two spawned ranks: ~20 s on the 2-core machine; the one sharded DCP source
def test_dcp_saved_by_two_ranks_is_gathered_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "dcp"
    assert run_ranks(save_dcp_from_ranks, 2, str(src)) == [True, True]
    assert len(list(src.glob("*.distcp"))) == 2
    out = dest()
    rc, text, err = cli(capsys, "convert", src, out)
    assert rc == 0, err
    assert "(dcp)" in text and "2 tensors" in text
    loaded = tg.load(out)
    assert_same(loaded["model"]["emb"], EMB)
    assert_same(loaded["model"]["bias"], torch.tensor([1.5, -3.0]))
    assert loaded["step"] == 9


def test_dcp_refuses_a_pickled_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.ones(2), "odd": argparse.Namespace(lr=0.1)},
            checkpoint_id=str(src),
            no_dist=True,
        )
    rc, _, err = cli(capsys, "convert", src, dest())
    assert rc == 1
    assert "the value at key 'odd' is a pickled Python object" in err
    assert "argparse.Namespace" in err
    assert "never unpickles arbitrary objects" in err


class RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("unpickled code ran",))


def test_dcp_metadata_is_unpickled_allowing_dcp_classes_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(src), no_dist=True)
    (src / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    rc, out, err = cli(capsys, "convert", src, dest())
    assert rc == 1
    assert "unpickled code ran" not in out
    assert f"{src}/.metadata: refusing to unpickle it (builtins.print is not a DCP" in err


def test_dcp_missing_a_data_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(src), no_dist=True)
    for data in src.glob("*.distcp"):
        data.unlink()
    rc, _, err = cli(capsys, "convert", src, dest(), "--from", "dcp")
    assert rc == 1
    assert f"{src}: torch.distributed.checkpoint cannot read it (FileNotFoundError" in err
    assert "with every .distcp file its .metadata names?" in err


def test_safetensors_folder_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "hf"
    src.mkdir()
    tensors = {k: v for k, v in state()["model"].items() if isinstance(v, torch.Tensor)}
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text("{}")
    out = dest()
    rc, text, err = cli(capsys, "convert", src, out)
    assert rc == 0, err
    assert "(safetensors)" in text and "2 tensors" in text
    assert_same(dict(sorted(tensors.items())), dict(sorted(tg.load(out).items())))
    meta = tg.read_manifest(out)["metadata"]
    assert meta["safetensors_metadata"] == {"format": "pt"}


def test_sharded_safetensors_folder_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "hf"
    src.mkdir()
    g = torch.Generator().manual_seed(1)
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.layers.0.weight": torch.randn(4, 4, generator=g),
            "model.embed.weight": torch.randn(10, 4, generator=g).half(),
        },
        "model-00002-of-00002.safetensors": {"lm_head.weight": torch.randn(10, 4, generator=g)},
    }
    for name, tensors in shards.items():
        save_file(tensors, src / name)
    weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    out = dest()
    rc, text, err = cli(capsys, "convert", src, out, "--json")
    assert rc == 0, err
    assert json.loads(text)["tensors"] == 3
    loaded = tg.load(out)
    assert sorted(loaded) == sorted(weight_map)
    for tensors in shards.values():
        for k, v in tensors.items():
            assert_same(v, loaded[k], k)

    # A shard the index names but the folder lacks: named, with what to do.
    (src / "model-00002-of-00002.safetensors").unlink()
    rc, _, err = cli(capsys, "convert", src, dest())
    assert rc == 1
    assert "model-00002-of-00002.safetensors" in err and "download every shard" in err


def test_detection(tmp_path: Path) -> None:
    from tardigrade.cli.convert import detect

    torch.save({"a": torch.ones(1)}, tmp_path / "a.bin")
    assert detect(str(tmp_path / "a.bin")) == "torch"
    save_file({"a": torch.ones(1)}, tmp_path / "a.safetensors")
    assert detect(str(tmp_path / "a.safetensors")) == "safetensors"
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(tg.InvalidArgumentError, match=r"notes.txt: cannot tell what this file"):
        detect(str(tmp_path / "notes.txt"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(tg.InvalidArgumentError, match=r"cannot tell what this directory holds"):
        detect(str(empty))
    tg.save(tmp_path / "tg", {"a": torch.ones(1)})
    with pytest.raises(tg.InvalidArgumentError, match=r"a Tardigrade checkpoint already"):
        detect(str(tmp_path / "tg"))


def test_a_pickle_only_torch_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "whole-model.pt"
    torch.save({"model": torch.nn.Linear(2, 2), "args": collections.Counter("ab")}, src)
    out = dest()
    rc, _, err = cli(capsys, "convert", src, out)
    assert rc == 1
    assert f"{src}: torch.load(weights_only=True) refuses this file" in err
    assert "never unpickles arbitrary objects" in err
    assert "torch.load(path, weights_only=False)" in err and "tg.save(dest, state)" in err
    assert "Unsupported global" in err
    with pytest.raises(tg.CheckpointNotFoundError):
        tg.load(out)


def test_a_missing_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(capsys, "convert", tmp_path / "nope.pt", dest())
    assert rc == 1
    assert f"{tmp_path / 'nope.pt'}: no such file or directory" in err
    rc, _, err = cli(capsys, "convert", tmp_path / "nope", dest(), "--from", "dcp")
    assert rc == 1 and "no such file or directory" in err


def test_an_existing_dest_needs_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(3)}, src)
    out = tmp_path / "ckpt"
    tg.save(out, {"w": torch.zeros(3)})
    rc, _, err = cli(capsys, "convert", src, out)
    assert rc == 1
    assert "already exists" in err and "--overwrite" in err
    assert torch.equal(tg.load(out)["w"], torch.zeros(3))
    assert cli(capsys, "convert", src, out, "--overwrite")[0] == 0
    assert torch.equal(tg.load(out)["w"], torch.ones(3))


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(3, dtype=torch.float64), "step": 3}, src)
    out = dest()
    rc, text, _ = cli(capsys, "convert", src, out, "--json", "--step", "3")
    assert rc == 0
    assert json.loads(text) == {
        "source": str(src),
        "kind": "torch",
        "dest": out,
        "tensors": 1,
        "nbytes": 24,
        "other_values": 1,
        "step": 3,
    }


def test_a_wrong_from_names_what_it_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(3)}, src)
    rc, _, err = cli(capsys, "convert", src, dest(), "--from", "safetensors")
    assert rc == 1 and f"{src}: not a safetensors file safetensors can read" in err
    rc, _, err = cli(capsys, "convert", tmp_path, dest(), "--from", "torch")
    assert rc == 2 and f"{tmp_path}: --from torch needs a file written by torch.save" in err
    rc, _, err = cli(capsys, "convert", tmp_path, dest(), "--from", "safetensors")
    assert rc == 2 and f"{tmp_path}: no .safetensors file here" in err
    rc, _, err = cli(capsys, "convert", src, dest(), "--from", "dcp")
    assert rc == 2 and "--from dcp needs a DCP checkpoint directory" in err


def outside_and_source(tmp_path: Path) -> tuple[Path, Path]:
    """A folder SOURCE and a file with secret tensors beside it (never to be converted)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"secret": torch.full((3,), 7.0)}, outside / "x.safetensors")
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(2)}, src / "model-1.safetensors")
    return outside, src


def refused(capsys: pytest.CaptureFixture[str], src: Path) -> str:
    """Convert ``src``, which must fail writing nothing; its error message."""
    out = dest()
    rc, _, err = cli(capsys, "convert", src, out)
    assert rc == 1
    with pytest.raises(tg.CheckpointNotFoundError):
        tg.load(out)
    return err


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_safetensors_index_cannot_name_a_file_outside_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    outside, src = outside_and_source(tmp_path)
    named = {
        "dotdot": "../outside/x.safetensors",
        "absolute": str(outside / "x.safetensors"),
        "symlink": "link.safetensors",
    }[how]
    if how == "symlink":
        (src / "link.safetensors").symlink_to(outside / "x.safetensors")
    weight_map = {"w": "model-1.safetensors", "secret": named}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    err = refused(capsys, src)
    assert f"{src}/model.safetensors.index.json: names" in err and "Refusing to read it" in err


def test_a_folder_symlink_leading_out_is_refused_without_an_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside, src = outside_and_source(tmp_path)
    (src / "z.safetensors").symlink_to(outside / "x.safetensors")
    rc, _, err = cli(capsys, "convert", src, dest(), "--from", "safetensors")
    assert rc == 1 and "a symbolic link that leads out of" in err


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_a_dcp_metadata_cannot_name_a_file_outside_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    outside, src = tmp_path / "outside", tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.full((2,), 7.0)}, checkpoint_id=str(outside), no_dist=True)
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(src), no_dist=True)
    (far,) = outside.glob("*.distcp")
    # Only DCP's own classes, so the unpickler's allow-list passes: the path is the attack.
    metadata = pickle.loads((src / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = f"../outside/{far.name}" if how == "dotdot" else str(far)
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    err = refused(capsys, src)
    assert f"{src}/.metadata: names" in err and "not a relative path inside" in err


@pytest.mark.parametrize("link", [False, True])
def test_a_fifo_in_place_of_a_file_is_refused_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], link: bool
) -> None:
    import os

    src = tmp_path / "hf"
    src.mkdir()
    fifo = src / ("pipe" if link else "model.safetensors")
    os.mkfifo(fifo)
    if link:  # a link inside SOURCE to a FIFO inside it
        (src / "model.safetensors").symlink_to(fifo)
    rc, _, err = cli(capsys, "convert", src, dest())
    assert rc == 1 and "not a regular file" in err
    # SOURCE itself a FIFO, with and without --from.
    for extra in ([], ["--from", "safetensors"], ["--from", "torch"]):
        rc, _, err = cli(capsys, "convert", fifo, dest(), *extra)
        assert rc == 1 and "not a regular file" in err, err


def test_a_tensor_of_more_than_64_dimensions_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = torch.ones([1] * 65)
    with pytest.raises(tg.UnsupportedTypeError, match=r"state\['model'\]\['w'\]: tensor has 65"):
        tg.save(tmp_path / "a", {"model": {"w": deep}})
    with pytest.raises(tg.UnsupportedTypeError, match=r"state\['s'\]: sharded tensor has 65"):
        tg.save(tmp_path / "b", {"s": tg.Sharded(deep, [0] * 65, [1] * 65)})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    torch.save({"model": {"w": deep}}, tmp_path / "deep.pt")
    rc, _, err = cli(capsys, "convert", tmp_path / "deep.pt", dest())
    assert rc == 1 and "state['model']['w']: tensor has 65 dimensions" in err


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    return model, optim


def test_a_converted_training_checkpoint_resumes_into_live_objects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A state_dict saved as a plain tree loads into the object that produced it (its
    load_state_dict, optimizer state included), and a manager restores it."""
    model, optim = trained()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": 7},
               tmp_path / "train.pt")  # fmt: skip
    run = tmp_path / "run"
    rc, _, err = cli(capsys, "convert", tmp_path / "train.pt", run / "step-000000007", "--step", 7)
    assert rc == 0, err
    torch.manual_seed(1)
    live_model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    live_optim = torch.optim.Adam(live_model.parameters(), lr=0.5)
    live = {"model": live_model, "optim": live_optim, "step": 0}
    with tg.CheckpointManager(run, live) as mgr:
        assert mgr.restore() == 7
    assert live["step"] == 7
    assert_same(model.state_dict(), live_model.state_dict())
    assert_same(optim.state_dict()["state"], live_optim.state_dict()["state"])
    assert live_optim.param_groups[0]["lr"] == 0.01


def test_strict_false_reports_every_part_it_skips(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, _ = trained()
    tg.save(tmp_path / "ckpt", {"model": model.state_dict(), "step": 7})
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 5))
    live = {"model": other, "step": 0, "extra": 1}
    caplog.set_level("WARNING", logger="tardigrade")
    tg.load(tmp_path / "ckpt", into=live, strict=False)
    (warning,) = [r.getMessage() for r in caplog.records if "strict=False" in r.getMessage()]
    assert "skipped 3 part(s)" in warning, warning
    for part in ("state['model']['2.weight']", "state['model']['2.bias']", "state['extra']"):
        assert part in warning
    assert live["step"] == 7 and torch.equal(other[0].weight, model[0].weight)  # the rest loaded
