"""A DDP training loop run by tests/distributed/test_elastic.py under ``torchrun --max-restarts``.

Usage: ``_elastic_script.py OUT SHM KILL_AT LAST``. Each rank plays a node of its own (its own
``TARDIGRADE_NODE`` and RAM directory under SHM), saves every 2nd step to RAM + peers and every
4th to the directory OUT/ckpt. On torchrun's first attempt rank 1 kills itself (SIGKILL) before
step KILL_AT (0: never), its node lost with it (its memory emptied on the restart); torchrun
restarts every worker, which resume from memory (rank 1's share from node 0's replica). At the end
each rank writes its losses, and the final model and optimizer state, under OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import tardigrade as tg
from tardigrade.manager._tiers import PeerTier


def main() -> None:
    out, shm, kill_at, last = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.environ["TARDIGRADE_NODE"] = f"node{rank}"
    memory = os.path.join(shm, f"node{rank}")  # the node's memory filesystem
    if attempt and rank == 0:
        # Node 1 was lost with the rank: its restart comes up on a fresh machine, whose
        # memory holds nothing of the job (only node 0 keeps a replica of its share).
        shutil.rmtree(os.path.join(shm, "node1"), ignore_errors=True)
    dist.barrier()
    os.makedirs(memory, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    state = {"model": model, "opt": opt, "sched": sched}
    losses: dict[int, float] = {}
    with tg.CheckpointManager(
        out / "ckpt",
        state,
        every_steps=2,
        persist_every=4,
        ram_tier=memory,
        peer_replicas=1,
        timeout=60,
    ) as mgr:
        start = mgr.restore()
        for step in range((start or 0) + 1, last + 1):
            if attempt == 0 and rank == 1 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: torchrun restarts everyone
            g = torch.Generator().manual_seed(step * 100 + rank)
            x = torch.randn(16, 8, generator=g)
            loss = ((ddp(x) - x.flip(1)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses[step] = loss.item()
            mgr.step(step)
            if attempt == 0 and step == kill_at - 1:
                mgr.wait()  # step kill_at - 1 is committed in memory, its replicas kept,
                peers = mgr._tiers.first(PeerTier)
                assert peers is not None and peers.replicator.wait(60)
                dist.barrier()  # on both ranks, before rank 1 dies
        (out / f"report-{rank}-{attempt}.json").write_text(
            json.dumps({"start": start, "from": mgr.restored_from, "losses": losses})
        )
        # DDP keeps the ranks' models and optimizers equal: one collective save holds them.
        state = {"model": model.state_dict(), "opt": opt.state_dict()}
        tg.save(out / "final", state, overwrite=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
