"""README and docs examples run as written: each is cut out of README.md or a page of docs/ and
run in a fresh interpreter.

An example is a promise to users; extracting it (rather than keeping a copy here) means an edit
to the README or a page that breaks it, or drops the line that checks its claim, fails a test.
A block is found by a line only it holds, wherever it lives, so moving an example between the
README and the pages needs no change here. docs/research/ holds measurement records, not
examples, and is not searched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SOURCES = [README, *sorted((ROOT / "docs").glob("*.md"))]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def python_blocks() -> list[str]:
    """Every ```python block of the README and of the docs pages."""
    return [
        block
        for source in SOURCES
        for block in re.findall(r"^```python\n(.*?)^```", source.read_text(), re.M | re.S)
    ]


def readme_block(containing: str) -> str:
    """The one ```python block of the README or a docs page that contains ``containing``."""
    found = [b for b in python_blocks() if containing in b]
    assert len(found) == 1, f"{len(found)} README/docs python blocks contain {containing!r}"
    return found[0]


def run_module(args: list[str], workdir: Path) -> subprocess.CompletedProcess[str]:
    """``python -m <args>`` in ``workdir``: a launcher or test runner on an example."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=workdir,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=240,
    )


def run_example(code: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    script = workdir / "example.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=workdir,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_augmentation_example_resumes_the_same_augmented_batch(tmp_path: Path) -> None:
    """The "Random augmentation that resumes exactly" example: after a save at batch 4 and a
    restart with another worker count, the next batch equals the 5th batch of the first run
    bit for bit (the example asserts it). Without ``tg.SeededDataset`` that same assertion
    fails, so it is the wrapper, not the example's setup, that makes the batches equal; and
    the batch really is augmented (no row equals an unaugmented one)."""
    code = readme_block("tg.SeededDataset(Jitter())")
    claim = "    assert torch.equal(next(iter(sampler.track(loader))), fifth)\n"
    assert code.endswith(claim), "the example no longer ends with its bit-exactness check"
    augmented = (
        "    raw = Jitter().x\n"
        "    assert not any(torch.equal(row, r) for row in fifth for r in raw)\n"
        "    print('RESUMED BIT-EXACT')\n"
    )
    (tmp_path / "seeded").mkdir()
    run = run_example(code + augmented, tmp_path / "seeded")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == ["RESUMED BIT-EXACT"], run.stdout + run.stderr
    assert (tmp_path / "seeded" / "ckpt" / "aug" / "manifest.json").is_file()

    unseeded = code.replace("tg.SeededDataset(Jitter())", "Jitter()")
    assert unseeded != code
    (tmp_path / "unseeded").mkdir()
    run = run_example(unseeded, tmp_path / "unseeded")
    assert run.returncode != 0, "without SeededDataset the resumed batch should differ"
    assert "AssertionError" in run.stderr and claim.strip() in run.stderr, run.stderr


def test_rows_of_a_table_example_loads_those_rows(tmp_path: Path) -> None:
    """The "Some rows of a table" example (Distributed section) runs and checks its rows."""
    code = readme_block("rows = tg.Sharded(")
    assert "assert torch.equal(rows.local, table[a:b])" in code
    run = run_example(code + "print('ROWS OK')\n", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == ["ROWS OK"], run.stdout + run.stderr


def test_faulty_storage_example_runs(tmp_path: Path) -> None:
    done = run_example(readme_block("FaultyStorage("), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "injected ENOSPC" in done.stdout
    assert "'commit': 1" in done.stdout  # the second save committed


@pytest.mark.parametrize(
    "marker",
    [
        "plugins=[TardigradeCheckpointIO()],",
        "TardigradeTrainer(model=Regressor()",
        "accelerator.register_for_checkpointing(progress)",
    ],
    ids=["lightning", "transformers", "accelerate"],
)
def test_framework_examples_run_and_check_their_resume(tmp_path: Path, marker: str) -> None:
    """Each Frameworks example trains, is restarted from its checkpoint and asserts where it
    resumed (steps, epochs, rotation); it must end with those checks."""
    code = readme_block(marker)
    assert code.rstrip().splitlines()[-1].lstrip().startswith("assert "), "no closing check"
    run = run_example(code + "\nprint('EXAMPLE OK')\n", tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.splitlines()[-1] == "EXAMPLE OK", run.stdout[-2000:] + run.stderr[-2000:]


def test_distributed_example_runs_under_torchrun(tmp_path: Path) -> None:
    """The Distributed section's example, as written, on 2 gloo ranks (torchrun)."""
    code = readme_block("# torchrun --nproc-per-node 2 train.py")
    (tmp_path / "train.py").write_text(code)
    run = run_module(["torch.distributed.run", "--nproc-per-node", "2", "train.py"], tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert (tmp_path / "ckpt" / "step-100" / "manifest.json").is_file()


def test_reader_example_prints_what_the_checkpoint_holds(tmp_path: Path) -> None:
    """The "Reading checkpoints from your own tools" example: the manifest as typed values,
    the tensors by path with dtype and shape, a verified read, the catalog's listing."""
    run = run_example(readme_block("tg.Checkpoint.open("), tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    data = next((tmp_path / "tools" / "step-000000007").glob("data-*"))
    assert run.stdout.splitlines() == [
        f"4 7 {{'run': 'a'}} {data.stat().st_size} 1",
        "model/weight F32 (2, 4)",
        "model/bias F32 (2,)",
        "2 tensors verified",
        "step-000000007 committed 7",
    ], run.stdout


def test_tour_example_saves_retires_and_resumes(tmp_path: Path) -> None:
    """The docs home page's tour: the first run saves steps 0, 10 and 20 and keeps two; the
    second resumes from step 20 and saves nothing new, as the page says."""
    script = tmp_path / "tour.py"
    script.write_text(readme_block(TOUR_MARKER))
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=dict(os.environ),
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.splitlines() == ["[10, 20]", "True", "torch.Size([4, 16])"], run.stdout
    assert sorted(p.name for p in (tmp_path / "tour" / "run").glob("step-*")) == [
        "step-000000010",
        "step-000000020",
    ]


# Every ```python block of the README and the docs pages runs: alone, or after the blocks it
# continues (the Quickstart's state, the manager's loop). Each block is named by a line only it
# holds; a block no test names fails test_every_readme_block_is_run, so a new example cannot go untested.
CHAINS = {
    "quickstart": [
        'result = tg.save("ckpt/step-000000100", state, step=100',
        'tg.load("ckpt/step-000000100", into=state)',
        'tree = tg.load("ckpt/step-000000100")',
    ],
    "manager": [
        'mgr = tg.CheckpointManager(\n    "runs/exp1",',
        'tg.CheckpointManager("runs/exp2", state)  # a second',
    ],
    "async": [
        'result = tg.save("ckpt/step-000000100", state, step=100',
        'fut = tg.save("ckpt/step-000000200", state, step=200, async_=True)',
        "with tg.AsyncCheckpointer(max_staging_bytes=256 * 2**20) as ckpt:",
        'fut = ckpt.save("ckpt/step-000000500", live, step=500, overlap=True)',
    ],
    "cadence": [
        'result = tg.save("ckpt/step-000000100", state, step=100',
        "policy = tg.OverheadBudget(max_overhead=0.02) | tg.EverySteps(1000)",
    ],
    "data position": [
        'result = tg.save("ckpt/step-000000100", state, step=100',
        "dataset = TensorDataset(torch.randn(1000, 16))",
    ],
    "ram tier": [
        'raise RuntimeError("the node hiccups at step 25")  # a crash: the RAM tier stays',
    ],
    "job runner": [
        'result = tg.save("ckpt/step-000000100", state, step=100',
        'state = {"model": model, "optim": optim, "epoch": 0}',
        "def download():  # on every rank",
    ],
}
# Blocks with a test of their own above.
S3_MARKER = "root = f\"s3://{os.environ.get('CKPT_BUCKET'"
TIER_MARKER = "remote = f\"s3://{os.environ.get('CKPT_BUCKET', 'my-bucket')}/runs/tiered\""
TOUR_MARKER = 'with tg.CheckpointManager("tour/run", state'
OPTIONS_MARKER = "/runs/options/step-000000001"
FSSPEC_MARKER = 'fsspec.register_implementation("scratch", Scratch)'
CONFORMANCE_MARKER = "class TestStoreTidy(conformance.StoreTidyContract): ..."
LORA_MARKER = 'with tg.CheckpointManager("runs/lora", state'
OWN_TESTS = [
    LORA_MARKER,
    "FaultyStorage(",
    "tg.Checkpoint.open(",
    "tg.SeededDataset(Jitter())",
    "rows = tg.Sharded(",
    "# torchrun --nproc-per-node 2 train.py",
    "plugins=[TardigradeCheckpointIO()],",
    "TardigradeTrainer(model=Regressor()",
    "accelerator.register_for_checkpointing(progress)",
    "assert_resumes_exactly(",
    S3_MARKER,
    TIER_MARKER,
    TOUR_MARKER,
    OPTIONS_MARKER,
    FSSPEC_MARKER,
    CONFORMANCE_MARKER,
]


def test_lora_example_writes_the_base_once_and_resumes(tmp_path: Path) -> None:
    """The fine-tuning example: the first save writes the 8 MiB base, the later ones its
    adapter and optimizer only; run again, it restores step 50 and saves nothing more."""
    code = readme_block(LORA_MARKER)
    run = run_example(code, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    written = json.loads(run.stdout.splitlines()[-1])
    assert len(written) == 5 and written[0] > 8 << 20, written
    assert all(n < 300_000 for n in written[1:]), written  # adapter, moments, biases
    assert len(list((tmp_path / "runs" / "lora" / ".shared").rglob("*.safetensors"))) == 2
    again = run_example(code, tmp_path)
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == "[]", again.stdout


def test_conformance_example_runs_the_suite_on_a_users_backend(tmp_path: Path) -> None:
    """The docs' conformance module, as a user's test file, passes under pytest (here on
    memory://, the backend its fixture names): every contract runs, none is skipped."""
    (tmp_path / "test_my_backend.py").write_text(readme_block(CONFORMANCE_MARKER))
    run = run_module(["pytest", "-q", "-p", "no:cacheprovider", "test_my_backend.py"], tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    m = re.search(r"(\d+) passed", summary)
    assert m is not None, summary
    passed = int(m.group(1))
    assert passed >= 20 and "skipped" not in summary and "failed" not in summary, summary


CONTINUES = "# Continues "  # the first line of a block that runs after the one(s) it names


@pytest.mark.parametrize("chain", list(CHAINS))
def test_readme_blocks_run_in_order(tmp_path: Path, chain: str) -> None:
    blocks = [readme_block(marker) for marker in CHAINS[chain]]
    # A reader sees which blocks do not run on their own: each says what it continues.
    for block in blocks[1:]:
        assert block.startswith(CONTINUES), f"unmarked continuation: {block.splitlines()[0]!r}"
    code = "\n".join(blocks)
    run = run_example(code + "\nprint('CHAIN OK')\n", tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.splitlines()[-1] == "CHAIN OK", run.stdout[-2000:]


def test_every_marked_continuation_is_run_as_one() -> None:
    """A block marked as a continuation is one in a chain (never run alone, where it fails);
    every other block runs on its own (a chain's head) or in a test of its own."""
    continuing = {m for chain in CHAINS.values() for m in chain[1:]}
    heads = {chain[0] for chain in CHAINS.values()}
    for block in python_blocks():
        if block.startswith(CONTINUES):
            assert any(m in block for m in continuing), block.splitlines()[0]
        else:
            assert not any(m in block for m in continuing - heads), block.splitlines()[0]


def test_every_readme_block_is_run() -> None:
    blocks = python_blocks()
    assert len(blocks) > 20, "the README and docs/*.md hold fewer examples than expected"
    markers = [m for chain in CHAINS.values() for m in chain] + OWN_TESTS
    untested = [b.splitlines()[0] for b in blocks if not any(m in b for m in markers)]
    assert not untested, f"README/docs python blocks no test runs: {untested}"


def test_kill_and_resume_example_checks_the_users_loop(tmp_path: Path) -> None:
    """The "Kill-and-resume tests for your own loop" example: ``kill_during`` dies inside the
    second commit (only the first checkpoint is visible, and verifies), and
    ``assert_resumes_exactly`` passes on the loop as written. (That the helper fails a loop
    that does not resume exactly, naming the first differing loss, is
    tests/faults/test_testing_helpers.py::test_assert_resumes_exactly_names_the_first_differing_loss.)"""
    code = readme_block("assert_resumes_exactly(")
    (tmp_path / "good").mkdir()
    run = run_example(code, tmp_path / "good")
    assert run.returncode == 0, run.stdout + run.stderr
    first, second = run.stdout.splitlines()
    assert first.startswith("True -9 commit #2: ") and first.endswith("manifest.json"), first
    assert second.startswith("30 steps; resumed exactly after: ['"), second
    assert (tmp_path / "good" / "ckpt" / "step-000000004" / "manifest.json").is_file()


def test_s3_example_runs_on_a_real_server(tmp_path: Path, s3_server: Any) -> None:
    """The "Object stores (S3)" example, against the session's SeaweedFS, configured as a
    user would: the AWS_* variables and the bucket name. Run twice: the second run resumes
    from the first's newest checkpoint, and retention kept two."""
    code = readme_block(S3_MARKER)
    env = {**os.environ, **s3_server.env(), "CKPT_BUCKET": s3_server.bucket}
    script = tmp_path / "example.py"
    script.write_text(code)
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=240,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.splitlines() == ["committed on the store: [15, 20]"], run.stdout
    from tardigrade.storage import open_root

    storage = open_root(f"s3://{s3_server.bucket}/runs/mlp", {**s3_server.options()})
    assert [n for n in storage.list() if n != ".lock"] == ["step-000000015", "step-000000020"]
    storage.delete("")


def test_tiered_example_uploads_and_restores_on_a_new_machine(
    tmp_path: Path, s3_server: Any
) -> None:
    """The "A remote tier" example: saves to a local directory upload to S3 in the
    background; a new machine (empty directory) restores step 30 from the remote tier."""
    code = readme_block(TIER_MARKER)
    env = {**os.environ, **s3_server.env(), "CKPT_BUCKET": s3_server.bucket}
    script = tmp_path / "example.py"
    script.write_text(code + "print('TIERS OK')\n")
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == ["TIERS OK"], run.stdout
    from tardigrade.storage import open_root

    storage = open_root(f"s3://{s3_server.bucket}/runs/tiered", {**s3_server.options()})
    assert [n for n in storage.list() if n != ".lock"] == ["step-000000020", "step-000000030"]
    storage.delete("")


def test_storage_options_example_needs_no_aws_variable(tmp_path: Path, s3_server: Any) -> None:
    """The "Storage options" example, against the session's SeaweedFS, in a process with no
    AWS_* variable: the endpoint and credentials reach S3 only as ``storage_options``."""
    code = readme_block(OPTIONS_MARKER)
    opts = s3_server.options()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        CKPT_ENDPOINT=opts["endpoint"],
        CKPT_KEY_ID=opts["access_key_id"],
        CKPT_SECRET=opts["secret_access_key"],
        CKPT_BUCKET=s3_server.bucket,
    )
    script = tmp_path / "example.py"
    script.write_text(code)
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == ["1 1"], run.stdout
    from tardigrade.storage import open_root

    open_root(f"s3://{s3_server.bucket}/runs/options", opts).delete("")


def test_fsspec_example_saves_through_a_registered_filesystem(tmp_path: Path) -> None:
    """The "Other stores through fsspec" example: a manager on a scheme that only fsspec
    serves keeps the newest checkpoint and loads it back."""
    run = run_example(readme_block(FSSPEC_MARKER), tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == ["[2] [2.0, 2.0, 2.0, 2.0]"], run.stdout
