"""The CLI for a new user: fast start, --json everywhere, progress on a terminal, export paths."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tardigrade as tg
from tardigrade import cli
from tardigrade.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    return env


def _imports(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -m tardigrade.cli ARGV``; return it and the modules it imported."""
    code = (
        "import runpy, sys; sys.argv = ['tardigrade', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('tardigrade.cli', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
        "    raise\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=_env(), timeout=60
    )
    return proc, set(proc.stderr.strip().splitlines()[-1].split())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpts")
    for step in (1, 2):
        tg.save(root / f"step-{step:09d}", {"w": torch.full((64, 64), float(step)), "step": step})
    return root


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint holding every leaf whose value is torch's: inspect shows them all."""
    path = tmp_path_factory.mktemp("rich") / "step-000000007"
    state = {
        "w": torch.ones(3),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cuda", 1),
        "gen": torch.Generator(),
        "keyed": {torch.float16: 1, torch.device("cpu"): 2},
        "c": torch.ones(2, dtype=torch.complex64),
        "sparse": torch.eye(3).to_sparse(),
        "packed": list(range(100)),
    }
    tg.save(path, state, step=7)
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["--help"],
        ["ls", "{dir}"],
        ["gc", "{dir}"],
        ["inspect", "{rich}"],
        ["inspect", "--json", "{rich}"],
    ],
)
def test_cheap_commands_do_not_import_torch(ckpts: Path, rich: Path, argv: list[str]) -> None:
    proc, modules = _imports(*(a.format(dir=ckpts, rich=rich) for a in argv))
    assert proc.returncode == 0, proc.stderr
    assert "torch" not in {m.split(".")[0] for m in modules}
    # Not even numpy (a tenth of the start-up on a loaded machine): ls and gc read names and
    # sizes, inspect decodes the tree (packed lists included) without it.
    assert "numpy" not in modules
    # Nor the store backends (and their clients): these checkpoints are local.
    assert not modules & {"tardigrade.storage.s3", "tardigrade.storage.fsspec", "fsspec"}
    if argv[0] == "inspect" and "--json" not in argv:
        # The torch values are shown as torch writes them, without torch.
        for line in (
            "dtype: torch.bfloat16",
            "size: torch.Size([2, 3])",
            "device: device(type='cuda', index=1)",
            "gen: torch.Generator(cpu)",
            "torch.float16: 1",
            "device(type='cpu'): 2",
            "c: C64[2]  16 B",
            "sparse: sparse coo F32[3, 3]  nnz=3  60 B",
            "packed: list[100] of int: [0, 1, 2, ..., 99]",
        ):
            assert line in proc.stdout, proc.stdout


def test_inspect_shows_torch_values_as_the_library_decodes_them(rich: Path) -> None:
    # The torch-free stand-ins print as the values tg.load returns do.
    from tardigrade.format.tree import decode

    ckpt = tg.Checkpoint.open(rich)
    real = ckpt.read()
    shown = decode(ckpt.manifest.raw["tree"], lambda n, p: None, "t", stand_ins=True)
    for key in ("dtype", "size", "device"):
        assert repr(shown[key]) == repr(real[key])
    assert [repr(k) for k in shown["keyed"]] == [repr(k) for k in real["keyed"]]


def test_a_command_still_runs_with_only_its_own_module_imported(ckpts: Path) -> None:
    proc, _ = _imports("verify", str(ckpts / "step-000000001"))
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stderr


def test_the_help_lines_match_the_commands() -> None:
    import importlib

    for name, help_line in cli.COMMANDS.items():
        assert help_line == importlib.import_module(f"tardigrade.cli.{name}").HELP


def test_verify_json_of_one_checkpoint_and_a_directory(
    ckpts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--json", str(ckpts / "step-000000002")]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["ok"] is True and one["tensors"] == 1 and one["nbytes"] > 64 * 64 * 4
    assert main(["verify", "--json", str(ckpts)]) == 0
    many = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in many["checkpoints"]] == ["step-000000001", "step-000000002"]
    assert many["failed"] == [] and many["checked"] == 2


def test_verify_json_reports_damage_with_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tg.save(tmp_path / "c", {"w": torch.ones(256)})
    data = next((tmp_path / "c").glob("data-*"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["verify", "--json", str(tmp_path / "c")]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and "checksum" in out["error"]


def test_gc_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / ".tmp-step-000000003-abc").mkdir()
    (tmp_path / ".tmp-step-000000003-abc" / "data-0.safetensors").write_bytes(b"x" * 100)
    assert main(["gc", "--json", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dry_run"] is False
    assert [(x["action"], x["name"]) for x in out["leftovers"]] == [
        ("removed", ".tmp-step-000000003-abc")
    ]


def test_export_creates_missing_folders_and_speaks_json(
    ckpts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "deeper" / "w.safetensors"
    assert main(["export", "--json", str(ckpts / "step-000000002"), str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["out"] == str(out) and report["tensors"] == 1
    assert torch.equal(load_file(out)["w"], torch.full((64, 64), 2.0))


def _on_a_terminal(*argv: str) -> str:
    """Run the CLI with stderr on a pseudo-terminal; return what the terminal showed."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tardigrade.cli", *argv],
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env=_env(),
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    proc.wait(timeout=60)
    os.close(leader)
    return shown.decode(errors="replace")


def test_verify_and_export_draw_progress_on_a_terminal_only(
    ckpts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = str(ckpts / "step-000000001")
    assert "verify step-000000001 (MiB) [" in _on_a_terminal("verify", ck)
    assert "export a.safetensors (MiB) [" in _on_a_terminal(
        "export", ck, str(tmp_path / "a.safetensors")
    )
    assert "[" not in _on_a_terminal("verify", "--quiet", ck)
    # Not a terminal (captured): no bar.
    assert main(["verify", ck]) == 0
    assert main(["export", ck, str(tmp_path / "b.safetensors")]) == 0
    assert "[" not in capsys.readouterr().err


def _gc_leftover(root: Path) -> None:
    dead = root / ".tmp-step-000000003-abc"
    dead.mkdir(exist_ok=True)
    (dead / "data-00000-of-00001.safetensors").write_bytes(b"x" * 3000)


def test_diff_and_gc_draw_progress_on_a_terminal(ckpts: Path, tmp_path: Path) -> None:
    a, b = str(ckpts / "step-000000001"), str(ckpts / "step-000000002")
    assert "diff (MiB) [" in _on_a_terminal("diff", a, b)
    _gc_leftover(tmp_path)
    shown = _on_a_terminal("gc", str(tmp_path))
    assert f"gc {tmp_path} [##############################] 1/1  2.9 KiB freed" in shown
    assert not (tmp_path / ".tmp-step-000000003-abc").exists()


@pytest.mark.parametrize("flag", ["--quiet", "--json", None])
def test_diff_and_gc_draw_no_bar_with_quiet_or_json_or_off_a_terminal(
    ckpts: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flag: str | None,
) -> None:
    if flag is not None:  # the terminal path, in process: stderr claims to be a terminal
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    flags = [flag] if flag else []
    _gc_leftover(tmp_path)
    assert main(["gc", *flags, str(tmp_path)]) == 0
    assert not (tmp_path / ".tmp-step-000000003-abc").exists()
    assert main(["diff", *flags, str(ckpts / "step-000000001"), str(ckpts / "step-000000002")]) == 1
    assert "[" not in capsys.readouterr().err


def test_gc_counts_each_leftover_in_its_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The terminal path in process: stderr claims to be a terminal.
    for i in range(3):
        dead = tmp_path / f".tmp-step-00000000{i}-abc"
        dead.mkdir()
        (dead / "data").write_bytes(b"x" * 1024 * (i + 1))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["gc", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "] 3/3  6.0 KiB freed" in err and "] 1/3" in err
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_the_torch_free_item_sizes_are_torchs() -> None:
    from tardigrade.format.dtypes import TORCH_DTYPES
    from tardigrade.format.sizes import ITEMSIZE

    assert {k: torch.empty((), dtype=v).element_size() for k, v in TORCH_DTYPES.items()} == ITEMSIZE


def test_export_counts_bytes_not_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One large tensor: a bar of tensors sat at 0/1 for its whole read; one of MiB moves."""
    tg.save(tmp_path / "ckpt", {"w": torch.ones(3 * 2**20 // 4 * 4)})  # one tensor of 12 MiB
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the terminal path, in process
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "w.safetensors")]) == 0
    err = capsys.readouterr().err
    assert "export w.safetensors (MiB) [" in err and "] 12/12" in err, err


@pytest.mark.parametrize(
    ("argv", "rc"),
    [
        (["diff", "{dir}"], 2),  # one checkpoint: a usage error
        (["export"], 2),
        (["convert", "nonexistent-source", "x"], 1),
        (["convert", "--from", "nope", "a", "b"], 2),
        (["export", "{dir}/missing", "out.safetensors"], 1),
        (["diff", "{dir}/missing", "{dir}/step-000000001"], 2),
    ],
)
def test_usage_and_missing_path_errors_come_before_torch_is_imported(
    ckpts: Path, argv: list[str], rc: int
) -> None:
    """torch takes seconds to import on a loaded machine: a typo must not wait for it."""
    proc, modules = _imports(*(a.format(dir=ckpts) for a in argv))
    assert proc.returncode == rc, proc.stderr
    assert "torch" not in {m.split(".")[0] for m in modules}, proc.stderr[-500:]
