"""Tardigrade's benchmark harness: ``python -m bench`` (or ``make bench``).

One run saves and loads the same training state with every registered tool, interleaved
(A B C ... A B C ...), next to the physical limits of this machine (fsync'd sequential write, hot
read, memcpy), times a training loop that saves every k steps asynchronously (Tardigrade, DCP)
next to the same loop without saves, and reports medians, throughput, ratios, peak RSS, the
loop's overhead and the targets of the performance issue as PASS/MISS.
``python -m bench --help`` lists the options.

Modules:

- ``state``   the training state: an MLP plus Adam moments after one optimizer step.
- ``measure`` timing plus peak RSS above the live state for one operation.
- ``raw``     the physical references: raw write + fsync (buffered and O_DIRECT), hot read, memcpy.
- ``tools``   the registry of saves and loads (tool name -> callable). Add a tool there.
- ``fresh``   the first save of a fresh process, one subprocess per tool.
- ``loop``    the training loop: steps/s with no checkpoints, Tardigrade async, DCP async.
- ``run``     the orchestration: first saves, then rounds in one process.
- ``distributed`` 2 ranks on gloo: collective save/load vs DCP and the raw write, 2 -> 1 load,
  replicated bytes, the agreement collective, the plan cache (``--no-distributed`` skips it).
- ``report``  statistics, targets, the printed table.
"""
