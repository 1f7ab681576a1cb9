"""What a user coming from torch.save gets: clear messages, and torch.Generator as a leaf."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tardigrade as tg
from tardigrade.errors import CheckpointNotFoundError, InvalidArgumentError, StateMismatchError


def test_loading_a_torch_save_file_says_what_it_is(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointNotFoundError, match=r"model\.pt: .*written by torch\.save") as e:
        tg.load(tmp_path / "model.pt")
    assert "torch.load(path, weights_only=True)" in str(e.value)
    assert "never committed" not in str(e.value)


def test_loading_another_file_says_it_is_no_checkpoint_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointNotFoundError, match=r"notes\.txt: this is a file, not a"):
        tg.load(tmp_path / "notes.txt")


def test_swapped_save_arguments_say_the_order(tmp_path: Path) -> None:
    target = str(tmp_path / "ck")
    with pytest.raises(InvalidArgumentError, match=r"takes the path first.*torch\.save") as e:
        tg.save({"w": torch.ones(2)}, target)  # type: ignore[arg-type]
    assert f"tg.save({target!r}, state)" in str(e.value)
    assert not Path(target).exists()


def test_a_generator_leaf_round_trips_its_stream(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(7)
    torch.rand(5, generator=g)
    tg.save(tmp_path / "ck", {"gen": g, "n": 1})
    want = torch.rand(5, generator=g)

    tree = tg.load(tmp_path / "ck")
    assert isinstance(tree["gen"], torch.Generator)
    assert torch.equal(torch.rand(5, generator=tree["gen"]), want)


def test_a_generator_is_restored_in_place_where_a_loader_holds_it(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(TensorDataset(torch.arange(20)), batch_size=4, shuffle=True, generator=g)
    tg.save(tmp_path / "ck", {"gen": g})
    want = [b[0].tolist() for b in loader]

    g2 = torch.Generator().manual_seed(99)
    loader2 = DataLoader(TensorDataset(torch.arange(20)), batch_size=4, shuffle=True, generator=g2)
    state = {"gen": g2}
    tg.load(tmp_path / "ck", into=state)
    assert state["gen"] is g2
    assert [b[0].tolist() for b in loader2] == want


def test_a_generator_does_not_replace_other_leaves_silently(tmp_path: Path) -> None:
    tg.save(tmp_path / "ck", {"gen": torch.Generator().manual_seed(1)})
    with pytest.raises(StateMismatchError, match=r"state\['gen'\]"):
        tg.load(tmp_path / "ck", into={"gen": torch.zeros(2)})
    tg.save(tmp_path / "ck2", {"gen": 5})
    with pytest.raises(StateMismatchError, match=r"state\['gen'\].*Generator"):
        tg.load(tmp_path / "ck2", into={"gen": torch.Generator()})


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        ({"v": "AAAA"}, "bad 'generator' value"),  # 3 bytes: no generator's state
        ({"v": "not base64!"}, "bad 'generator' value"),
        ({"device": {"t": "str", "v": "cpu"}}, "a generator's device is not a device"),
    ],
    ids=["state-size", "encoding", "device"],
)
def test_a_forged_generator_is_refused(tmp_path: Path, edit: dict, pattern: str) -> None:
    from tardigrade.errors import CorruptCheckpointError
    from tardigrade.format.jsonio import dumps
    from tardigrade.format.manifest import seal

    tg.save(tmp_path / "ck", {"gen": torch.Generator().manual_seed(1)})
    doc = tg.read_manifest(tmp_path / "ck")
    doc.pop("manifest_checksum", None)
    next(v for k, v in doc["tree"]["v"] if k["v"] == "gen").update(edit)
    (tmp_path / "ck" / "manifest.json").write_bytes(seal(dumps(doc)))
    with pytest.raises(CorruptCheckpointError, match=pattern):
        tg.load(tmp_path / "ck")


def test_the_cli_shows_and_compares_generators_by_their_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tardigrade.cli import main

    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        tg.save(tmp_path / name, {"gen": torch.Generator().manual_seed(seed)})
    assert main(["inspect", str(tmp_path / "a")]) == 0
    assert "gen: torch.Generator(cpu)" in capsys.readouterr().out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    assert "state['gen']  torch.Generator(cpu, state #" in capsys.readouterr().out


def test_first_hour_messages_name_the_fix(tmp_path: Path) -> None:
    """A torch.save file names `tardigrade convert`; a run directory given to tg.load says it
    holds checkpoints and names one; a checkpoint given as a manager's directory is refused."""
    torch.save({"a": torch.ones(2)}, tmp_path / "train.pt")
    with pytest.raises(tg.CheckpointNotFoundError, match="tardigrade convert"):
        tg.load(tmp_path / "train.pt")
    run = tmp_path / "run"
    for step in (1, 2):
        tg.save(run / f"step-00000000{step}", {"a": torch.ones(2)})
    with pytest.raises(tg.CheckpointNotFoundError) as e:
        tg.load(run)
    assert "a directory of 2 checkpoint(s)" in str(e.value)
    assert f"name one (e.g. {run}/step-000000002)" in str(e.value)
    with pytest.raises(tg.InvalidArgumentError, match="this is one checkpoint") as e:
        tg.CheckpointManager(run / "step-000000001", {"a": torch.ones(2)})
    assert f"CheckpointManager({str(run)!r}, ...)" in str(e.value)
    assert sorted(p.name for p in (run / "step-000000001").iterdir()) == [
        "data-00000-of-00001.safetensors",
        "manifest.json",
    ]  # nothing was written into the checkpoint (no lock, no nested save)
