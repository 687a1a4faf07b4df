"""OffloadScheduler: keeps a window of layers in memory while the rest of a training step waits on disk.

Three threads share the work (nntrainer issue #789's design):

* the **executor** is the thread that runs the network; it calls this scheduler through the
  network's hooks and through ``mgr.create`` (the scheduler is the memory *provider* of ACTIVATIONS
  and FF_CACHE in training mode, so those tensors live in the scheduler's arena, nowhere else);
* the **saver** writes a layer's saved tensors to the swap file once the forward no longer reads
  them, then frees their bytes;
* the **loader** reads them back, N steps before the backward that needs them.

Every unit (a node's saved or transient tensors, see ``engine.offload.plan``) is in one state:

    RELEASED        holds no bytes this step (not produced yet, or freed after its last use)
    READY_FOR_EXEC  in memory, usable by the executor
    WAIT_FOR_OFF    being saved (in memory, leaving)
    SWAPPED         on disk only
    WAIT_FOR_EXEC   being loaded (coming back)

Transitions are logged at DEBUG on ``logging.getLogger("engine.offload")``.

Memory is bounded by construction: a unit moves into its arena bytes (the executor creating it, or
the loader reading it) only after every earlier occupant of those bytes has left. So an onload waits
for the offload that frees its room, and the executor waits for a save only when the room it needs
is still being saved. A tensor of a unit that is not in memory has its (pseudo-)workspace closed: a
kernel handed such a tensor raises instead of reading someone else's bytes.

**One region with the step arena** (``sharing``: the cpu backend, a fixed N, no byte budget). The network's
planned arena (activation gradients, working memory, per-layer gradients) peaks late in the backward, on the
largest planes; this arena early in the forward, while the first layers' units are written. Side by side a run
holds both peaks; so the units are placed in the bytes the step arena's tensors leave free while they are alive
(``plan.place_around``), in one region whose start is the step arena's block (``PlannedArena.host``,
``shared_block``). Two more orders keep it safe: a unit's occupation moves in only after the executor has passed
the last moment of every step tensor that held its bytes before (``SharedLayout.gates``, in ``_room_free``: the
loader may start early), and before a moment's step tensors are made the executor waits until the units that held
their bytes have left them (``SharedLayout.waits``, in the after-hooks: a save may lag past its span). ImageNet
variants at 224, N=1, every chunked layer recomputing (``engine memory --batch-size 32,128``): ResNet-18's
smallest limit 448 → 384 MiB at batch 32 and 1.02 GiB → 896 MiB at batch 128; MobileNetV2's step arena and its
units overlap less (592 → 576 MiB). A byte budget counts the units' own arena (``keep_within`` fills it, ``auto``
grows the window into it), so a run with one keeps the arenas apart; ``auto`` at its floor runs N=1 without one
(``engine.offload.budget.resolve_budget``).

The window N (lag of the saver and lookahead of the loader, in steps) is fixed, or ``"auto"``: after
a step in which the executor waited, N grows; after ``shrink_after`` steps in which the executor never
waited and both IO threads were idle most of the time, it shrinks; never past the byte budget. Under a
budget, not below ``BUDGET_WINDOW`` and not to a window that writes more (the budget, not the window,
keeps units: ``plan.keep_within``).
With ``"auto"`` (``predict_leads``; a fixed N keeps exactly its window unless asked) the loader predicts each unit's
load time from the read bandwidth it measured (bytes read / loader busy time, averaged over steps)
and the unit's bytes, and starts the load that many timeline steps ahead (timed by the executor in
the previous step), N at least (Capuchin's feedback: a load still in flight when needed moves
earlier); with ``"auto"`` no further than the largest useful window, with a fixed N no further back
than the length of the backward. Loading earlier than the plan's window is safe: a load waits until
every earlier occupant of its bytes has left (``_room_free``), so the resident bytes stay inside the
plan's arena; it only holds memory sooner. ``StepStats.lead_steps`` reports the longest lead used.
Why not for a fixed N by default: DESIGN.md promises a fixed window of N layers (plus one loading
and one saving, N+2 at most), and a prediction can start more loads than that; the bytes would stay
inside the arena, but the user asked for N. What it would buy, measured (``predict_leads=True``
with a fixed N): the loads of MobileNetV2's 12-18 MiB units arrive
late at N=4 (``/tmp``'s disk reads ~0.9 GiB/s here while the backward runs). Steps alternating in
one process (no offload, N=4 as before, N=4 predicting), two runs each, nothing else running: stall
per step at batch 32 8.0 -> 5.5 and 13.7 -> 2.9 ms, step 1.204 -> 1.206x and 1.319 -> 1.309x; at
batch 128 13.0 -> 5.1 and 15.3 -> 4.7 ms, 1.116 -> 1.109x and 1.167 -> 1.162x; the resident peak
of saved tensors unchanged (63 / 57 and 228 MiB). Loading everything as soon as its bytes are free
(no prediction) stalled less still but cost batch 32 22-28 ms per step (below). ``engine bench
--model resnet18,mobilenetv2 --batch-size 32,128 --offload-n 4``, fccf69d and this code alternating,
two runs each: MobileNetV2 b32 1.190 / 1.189 -> 1.185 / 1.223x (stall 4.8 / 10.0 -> 3.2 / 8.9 ms),
b128 1.193 / 1.178 -> 1.149 / 1.159x (stall 24.0 / 20.1 -> 13.3 / 6.9 ms); ResNet-18 b32 1.113 /
1.004 -> 1.085 / 1.020x, b128 1.034 / 1.047 -> 0.989 / 1.028x (its loads were on time already).

Where the time goes (AMD EPYC Zen 4, 2 cores, MobileNetV2 batch 32, N=4, offload on and off
alternating their steps in one process as ``engine bench`` does). Each layer was timed with a pair
of hooks placed around the scheduler's hooks, so a layer's time leaves out the scheduler's. The step
went from 403 to 486 ms. The layers' own time went from 401 to 450 ms, spread over every kind of
layer: conv forward +17 ms, conv backward +12, batch norm +15, ReLU6 +4. The scheduler's hooks
added 34 ms: rebuilds 15, stall 6, bookkeeping the rest. There were almost no page faults (10 -> 13
minor faults per step). The executor's involuntary context switches went from 8 to 117 per step.
Per-thread scheduler statistics (``/proc/self/task/*/schedstat``) give the CPU time each thread
got: the executor 315 -> 380 ms, the conv pool thread 124 -> 132, Numba's OpenMP worker 163 -> 180,
the loader 24 and the saver 20. They also give the time each thread waited, ready to run, for a
core: 0.4 -> 18 ms per step for the executor. So the IO threads cost the step mainly by taking a
core from a kernel whose work is split evenly over two threads, and by pushing the kernels' data
out of the caches (the kernels slow down by about 12%).
``perf`` on the IO threads (10 steps) split their ~50 ms per step into:
- XXH3 hashing, ~13 ms;
- the kernel, ~17 ms: block layer, the virtio notification (``iowrite16``), pinning pages, context
  switches;
- the interpreter, ~20 ms. Most of that was ``np.prod`` in the plan's byte counts, now cached
  (``plan.TensorSpec.nbytes``).
Measured again on fccf69d with ``benchmarks/offload_costs.py --layers`` (same machine,
nothing else running, batch 32): step 370 -> 467 ms (1.26x); the layers 375 -> 420 ms; the scheduler's hooks
40.5 ms on the executor: before_backward 31.8 (rebuilds 13.3, stall 14.8 in that run, 4-15 over
runs), create 4.4, after_forward 2.4, after_backward 1.6. The saver's CPU 73 µs and the loader's
89 µs per MiB (15 and 18 ms per step); ``--offload-verify off`` takes both to ~40 µs per MiB and the
step to 1.19x (batch 128: 1.13 -> 1.10x), so XXH3 over bytes that are no longer in cache is about
half of the IO threads' CPU. The conv kernels' share on their pool thread
(``kernels.cpu.threads.run_shares``) comes back later while the IO threads run: the executor's
``future.result()`` waits took 8.8 ms per step without offload and 17.8 with (cProfile, 5 steps), the
"core taken from a kernel split evenly" above. The conv drivers now hand out their work in chunks
taken by whichever thread is free (``kernels.cpu.threads.run_chunks``, figures there: N=4 step −4%,
the executor's load waits 14 -> 9 ms, no offload unchanged). What would not pay,
measured before building it (same runs):
- recomputing the expand batch norms' outputs from the block input (``plan.recompute_candidates``);
- saving a unit right after its creator's forward, while its bytes are in cache, not after its
  last forward reader: the saver's CPU per MiB did not move (62-69 -> 66-71 µs, two runs);
- starting every load as soon as its planned bytes are free (``eager`` in offload_costs.py): the
  stall falls (batch 32 9-15 -> 2-5 ms, batch 128 17-21 -> 2-6 ms) and batch 128 gains 10-47 ms
  in 5 of 5 runs, but batch 32 loses 22-28 ms in 2 of 2 (the loads then compete with the saves and
  the forward's kernels; starting them at the backward's first step instead: -14 and +18 ms), so
  the loader starts a load only as early as its predicted load time needs (``predict_leads``).
Tried and dropped (``benchmarks/offload_threads.py``, MobileNetV2 batch 32, N=4, 16 steps alternating
in one process, median): rebuilding recomputed units on the loader, right after it loaded and hashed
their source (the bytes in cache; Numba's thread count set to 1 on the loader thread, the same
elementwise kernel, the same bits), instead of on the executor. Every rebuild on the loader: the
executor's rebuilds 13 -> 0 ms, but the loader's serial rebuilds took 17-19 ms per step for the
181 MiB, its next loads started later (load waits 13-16 -> 16-23 ms), and the step went 418.7 ->
425.2, 414.1 -> 405.0, 389.0 -> 411.2 and 396.6 -> 429.4 ms in four runs; only while the loader would
otherwise wait for its next load (106 of the 181 MiB): 389.0 -> 393.1 and 396.6 -> 435.8 ms. On two
busy cores the pass costs what it costs wherever it runs, and the loader is on the critical path of
the backward's loads. The executor keeps the rebuilds.
Tried and dropped: the IO threads at ``SCHED_IDLE`` (they run only on an idle core). The stall went
from 9 to 35-57 ms and the ratio from 1.23-1.24 to 1.29-1.36x. ``SCHED_BATCH`` (no wake-up
preemption), three alternating runs: 1.18-1.26x without it against 1.18-1.29x with it, no
difference. Nice 10 and 19 earlier (docs/offload.md, history): no gain.

Checks where the bytes are read anyway (``_FusedCheck``). With ``--offload-verify full`` the IO
threads hashed every record with XXH3, after the bytes had left the caches (saves run N steps after
the last forward reader; loads arrive by DMA): ~33 µs per MiB each way, about half of their CPU. But
88% of MobileNetV2's written bytes (181 of 206 MiB at batch 32) and 46% of ResNet-18's (38 of 82)
are the sources of ReLU rebuilds (batch-norm outputs), and two elementwise passes read exactly those
bytes already: the ReLU's forward, and the rebuild before the backward. Both now sum the source's
32-bit words as they read them (``kernels.cpu.elementwise.relu*_forward_checksum``: the ReLU's
exact bits plus (Σ w, Σ (i+1)·w) mod 2⁶⁴, which any changed byte changes); the storage still checks
those records' length, step and names, not their bytes (``SwapStorage.check_elsewhere``), and a
mismatch stops the run naming the layer and the tensor, as before. The fused pass costs nothing
measurable: 12 MiB, median of 7, caches flushed: ReLU6 alone 1.07 ms, fused 0.98; XXH3 on the same
bytes 0.53 ms from memory, 0.31 ms right after the ReLU read them. A first version summed on the
executor after the ReLU's forward (a second pass, in cache): after_forward went 3.2 -> 9.4 ms per
step; passing the fused kernel to the layer (``ReLU.forward_with_input_check``) took it back to
3.7. Measured with ``benchmarks/offload_costs.py --configs n4,io-hash`` (``io-hash``: every record
hashed by the IO threads, as before; steps alternating in one process, nothing else timed), step
io-hash -> n4: MobileNetV2 batch 32, 10-14 steps: 397.7 -> 390.9, 444.0 -> 457.4, 410.7 -> 393.8 and
480.5 -> 447.0 ms (1.353 -> 1.330, 1.312 -> 1.351, 1.407 -> 1.349, 1.456 -> 1.354x; and 580.9 -> 499.0
with the machine disturbed): -3% median, within this machine's noise; the IO threads' CPU 30.4 /
35.3 / 33.9 / 39.3 -> 20.0 / 24.5 / 19.4 / 22.5 ms per step (70-102 -> 44-62 µs per MiB). Batch 128, 8 steps: 1468.8 ->
1436.5 and 1454.2 -> 1411.4 ms (1.142 -> 1.117x, 1.154 -> 1.120x: -2.2% and -2.9%), IO CPU 89.5 ->
35.7 and 97.7 -> 35.0 ms (51-59 -> 20-23 µs per MiB). ResNet-18 batch 32 (38 of its 82 MiB checked
by the executor), 12 steps: 504.9 -> 518.1, 484.1 -> 486.9, 530.1 -> 509.6, 551.6 -> 567.0 ms
(noise), IO CPU 12.4 -> 12.2, 11.2 -> 9.5, 13.5 -> 10.8, 15.5 -> 11.7 ms. ``engine bench --model
resnet18,mobilenetv2 --batch-size 32,128 --offload-n 4``, main (9a2375e) and this code alternating,
three runs each, ratio main -> this: ResNet-18 b32 1.060 / 1.034 / 1.036 -> 1.026 / 1.093 / 1.102,
b128 1.082 / 1.063 / 1.062 -> 0.971 / 1.025 / 1.067; MobileNetV2 b32 1.335 / 1.336 / 1.398 -> 1.319 /
1.347 / 1.276, b128 1.217 / 1.180 / 1.222 -> 1.157 / 1.161 / 1.156; IO threads' CPU per step
12.6 / 12.1 / 12.9 -> 10.9 / 10.1 / 10.6, 38.7 / 35.8 / 39.1 -> 28.2 / 25.6 / 25.6, 32.0 / 36.5 / 34.6
-> 20.0 / 19.1 / 21.7 and 96.6 / 97.2 / 88.8 -> 35.4 / 37.8 / 40.0 ms. The rebuilds of an Add then a
ReLU (two sources, ResNet's second blocks) still leave their check to the IO threads: 36 MiB of
ResNet-18's 82, ~2 ms of IO CPU per step at batch 32.

Where MobileNetV2's batch-32 step goes after that (``offload_costs.py --configs n4,noio --layers``;
``noio``: the scheduler with verify off and no system call, the loaded bytes stale): no offload
331.9, noio 350.4 (1.056x; 1.125x in another run), n4 441.5 ms (1.330x). The layers take 349 / 338
/ 406 ms: without the IO they run as fast as with no offload, with it 57-68 ms slower; the hooks
28.5 ms without IO (rebuilds 15, create 3.6, after_forward 4.3, after_backward 2.5) and 44.5 with it
(the stall, 15, and room waits in create). So the IO costs the step 2-3x its threads' CPU (24 ms),
through the kernels it delays. Tried and dropped this session:
- fewer, larger IO calls (coalescing units): a stand-alone test (200 MiB written and read back at
  ~700 MiB/s by a thread while two-thread ReLU6 passes and a 512² sgemm run; medians of 3) gave the
  work 219.9 ms without IO and 234.6 / 237.8 / 240.3 ms with 1 / 4 / 16 MiB per call: the
  disturbance is per byte, not per call, so nothing was built. The IO threads' own CPU per call
  (one thread, nothing else running, verify off, median of 3): ``pwritev`` + ``preadv`` through
  O_DIRECT 32-37 / 68-74 / 108-161 µs for 1 / 4 / 16 MiB (~30 µs + ~8 µs per MiB), ``SwapStorage``'s
  Python 20-30 µs more; MobileNetV2 batch 32 makes 122 calls a step (61 units written, median
  1.9 MiB), so merging them all would save at most ~7 ms of IO CPU per step;
- ``sys.setswitchinterval`` 0.2 ms instead of 5 (the executor waits less for the GIL an IO thread
  holds): 1.255 / 1.254x at 5 ms against 1.270 / 1.264x at 0.2 ms, alternating processes: no gain;
- keeping more units resident with the headroom the memory goal leaves (0.30x; today 0.16x), an
  upper bound measured without building it (``keep:ROLE --blocks '1|2|3'``): the depthwise batch
  norms' outputs of blocks 1-3 kept, 206 -> 127 MiB written, 63 -> 86 MiB resident, 360.2 -> 349.0 ms
  (1.297 -> 1.256x); the expand ones, 176 MiB written, 93 MiB resident, 354.3 ms. Not built then: a
  fixed N promises N layers resident (DESIGN.md). Built since for a byte budget
  (``--offload-budget``, ``plan.keep_within``): what the window leaves of the budget keeps the largest
  swapped units whole, then ReLU outputs; a fixed N without a budget keeps exactly its window.
  ``offload_costs.py --configs n4,budget:0.3,budget:0.6,budget:1.2`` (MobileNetV2 batch 32, one
  process): 1.494x (206 MiB written, stall 25.5 ms), 1.278x (96.5 MiB, 1.0 ms, 117 MiB resident),
  1.068x (nothing written, 13.8 ms of rebuilds), 1.017x (everything kept, no rebuild); ResNet-18 batch
  32 ``budget:1.2``: 1.025x with 3.9 ms of hooks, against ``noio`` 1.061x with 13.1 ms. So with the
  disk's time gone, what is left of the cost is the rebuilds and ~2% of bookkeeping.

What the IO's extra cost is made of (``offload_costs.py``'s ``spin``, ``memfile``, ``sleep`` and
``unpinned`` configurations, figures in ``engine.offload.affinity``): not the hypervisor (steal 0-4
of ~8,000 ticks in /proc/stat over a run, iowait <= 1%); burning the IO threads' CPU without memory
traffic costs the step about its own CPU time (the conv drivers' chunks already absorb a core taken
from one share); the real IO costs about twice its CPU plus the stall, and a part of that is the
disk's completion interrupts on one CPU, which the IO threads now avoid (``io_cpus="auto"``).
The scheduler without system calls (``noio``) costs ResNet-18 batch 32 ~12.5 ms of hooks per step
(rebuilds 6.3, the rest 660 hook calls of 1-20 µs: create 1.9, after_forward 1.8, after_backward
1.1) and MobileNetV2 ~22 (rebuilds 12.0 for 181 MiB in and out, ~30 GB/s: at memory speed;
create 2.7, after_forward 3.1, after_backward 1.9). Tried and dropped: writing the rebuilds'
sources in fewer bytes (a bitmask plus the nonzeros, or zero runs): they are batch norms' outputs,
before the ReLU, with 0.0% zero words (MobileNetV2 181 MiB, ResNet-18 38 MiB at batch 32; zlib
level 1 keeps 93% of the bytes); the rest of ResNet-18's records hold 6.8% zero words.

The swap disk's floor and what the IO threads' CPU is made of (issue 11, 2026-11-26;
``benchmarks/offload_floor.py``, nothing else running, no offload and N=4 alternating their steps in
one process). The disk alone (/dev/vda, virtio, ext4, one thread, O_DIRECT, sequential, 256-512 MiB):
write 2.2-2.7 GiB/s, read 1.0-1.4 GiB/s, the same at 1 and 4 MiB per call (``dd`` with
``oflag/iflag=direct``: write 1.6-2.6 GB/s, read 1.1-1.4 GB/s, and reads no faster with 2 or 4 in
flight: 0.94-1.33 / 1.15-1.21 / 1.08-1.20 GiB/s at 1 / 2 / 4). While the step runs the IO moves at
that speed: MobileNetV2 batch 32 writes its 206 MiB per step at 2.0-2.1 GiB/s (99-101 ms inside the
calls) and reads them back at 1.29-1.37 GiB/s (151-156 ms). Against the step without offload
(forward 94-111 ms, backward 164-195 ms) that is 78-86% of the step with the disk busy, the reads
alone 80-95% of the backward; the loader was busy 139-171 ms of the 213-273 ms backward with
offload, and still the executor waited 5-19 ms per step for loads and 2-9 ms for room (saves).
Batch 128: 825 MiB each way, 329 ms of writes in a 406 ms forward, 493 ms of reads (1.6 GiB/s) in a
775 ms backward, disk busy 70% (at the disk-alone read rate of that sitting, 1.0 GiB/s, 101%).
ResNet-18 moves 82 / 328 MiB (batch 32 / 128): the disk is busy ~20% of its step, so its cost is CPU.
So MobileNetV2's stall is not a bandwidth wall (the sum of the IO fits in the step) but a window of
4 layers on a disk that has to run at 80-95% of its speed through the whole backward: any unit that
comes late (a large one after small ones) is a wait. How the stall follows the disk's speed, without
the IO's CPU (``offload_costs.py --configs n4,noio,sleep:W/R``: ``noio`` whose calls sleep as long
as the transfer takes at W MiB/s written, R read; batch 32, 10 steps, two runs): noio 1.065 / 1.061x;
at this disk's rates (2100/1350) stall 41 / 36 ms, 1.173 / 1.169x; reads twice as fast (2100/2700)
21 / 17 ms, 1.087 / 1.113x; writes twice as fast (4200/1350) 27 / 23 ms, 1.080 / 1.127x; the real
IO in the same runs: stall 14 / 13 ms, 1.195 / 1.240x (the sleeps overstate the stall: the rates
were measured inside the calls, which includes the IO thread's wait for a core after the disk is
done). At 5000 MiB/s both ways the stall is 1.1 ms (one run). Only fewer bytes (keeping or
recomputing more, both measured above), a faster disk or an earlier start (``predict_leads``,
above) move it.
The IO threads' CPU (MobileNetV2 batch 32): saver 13.2-13.8 ms per step (8.5-9.3 inside the
storage's calls), loader 16.8-17.9 (9.6-10.4 inside), i.e. 140-170 µs per call inside, and ~4 / ~7
ms of scheduler Python and condition waits outside. The same 61 calls each way with nothing else
running (``SwapStorage`` on a private anonymous mapping like the arena's, median of 3): verify off
71-77 µs per call (21-23 µs per MiB) with 2 MiB pages, 192-206 µs (57-61 µs per MiB) without
(``MADV_HUGEPAGE`` is worth 2.7x here: the per-4 KiB page pinning); verify full on every byte
175-198 µs. So inside the step a call costs about twice what it costs alone. ``perf record -e cpu-clock`` on the two
threads (1,235 samples, 8 steps): Python 43%, XXH3 5%, other user 5%; kernel 47%: scheduling,
futexes and context switches 17.5%, the virtio notification and interrupt return (``iowrite16``,
``_raw_spin_unlock_irqrestore``) 14.5%, block layer and ext4 5.7%, page pinning (``gup_fast``,
``bio_iov_iter_get_pages``) 2.2%. Not built: io_uring with registered buffers
(``IORING_OP_READ_FIXED`` / ``WRITE_FIXED``, the pip package ``liburing`` installs here). It removes
the per-IO page pinning, 2.2% of these threads' CPU (~0.7 ms per step); the virtio notification
(a VM exit per request) and the completion interrupt stay, and the Python around each call stays.
The executor's share (``noio``, above): the rebuilds alone are 12-17 ms per step at batch 32 and 48-55
ms at batch 128 (4.5-6% of the step without offload, at memory speed): above the 5% goal by
themselves. They cannot be done in place (the batch norm's backward reads its output, the source,
after the ReLU's and the conv's backward read the rebuilt one) and cannot move off the executor
(measured above). What would remove them: the consumers reading the batch norm's output and
clamping on load (the ReLU6 backward's mask is the same from either, 0 < y < 6, NaN and -0.0
included; the conv's weight gradient would need a clamped-input variant in each conv path) with
the source's check moving to a pass that reads it anyway; not built (every conv path's backward).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import logging
import mmap
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from engine.errors import DiskFaultError, UserError
from engine.history import History
from engine.memory.array_type import ArrayType
from engine.memory.manager import TensorProvider
from engine.memory.tensor import CLOSED, Tensor
from engine.offload.affinity import io_thread_cpus, pin_threads
from engine.offload.plan import (
    NETWORK_INPUT,
    PAGE,
    OffloadPlan,
    Recompute,
    SharedLayout,
    StepProgram,
    StepTensor,
    TensorSpec,
    UnitPlan,
    UnitSpec,
    align,
    budget_refusal,
    build_plan,
    largest_window,
    place_around,
    program_units,
    recompute_candidates,
)
from engine.offload.staging import transfer_for
from engine.offload.storage import VERIFY_MODES, DelayHook, SwapRecord, SwapStorage, format_bytes

log = logging.getLogger("engine.offload")

OFFLOADED_TYPES = (ArrayType.ACTIVATIONS, ArrayType.FF_CACHE)
# The window a byte budget alone gets (``--offload-budget`` without ``--offload-n``): the README's N, or
# less when even that does not fit; the rest of the budget keeps whole units (``plan.keep_within``).
# It was the largest window that fits, which spends the budget where it saves the fewest bytes:
# MobileNetV2 batch 32 with 118 MiB (0.30x of what it keeps without offload) wrote 205.9 MiB per step
# at N=8, 96.6 MiB at N=4 with the rest kept.
BUDGET_WINDOW = 4
FUSED_OP = "relu_forward_checksum"  # what a closed tensor's error names when the fused forward gets one


class LayerState(enum.Enum):
    RELEASED = "RELEASED"
    READY_FOR_EXEC = "READY_FOR_EXEC"
    WAIT_FOR_OFF = "WAIT_FOR_OFF"
    SWAPPED = "SWAPPED"
    WAIT_FOR_EXEC = "WAIT_FOR_EXEC"


RESIDENT = frozenset({LayerState.READY_FOR_EXEC, LayerState.WAIT_FOR_OFF, LayerState.WAIT_FOR_EXEC})
IN_FLIGHT = frozenset({LayerState.WAIT_FOR_OFF, LayerState.WAIT_FOR_EXEC})


class ProviderHost(Protocol):
    """The workspace manager as the scheduler uses it (``engine.memory.WorkspaceManager``)."""

    @property
    def closed(self) -> bool: ...
    def set_provider(self, array_types: ArrayType | Iterable[ArrayType], provider: TensorProvider | None) -> None: ...
    def provider_for(self, array_type: ArrayType) -> TensorProvider | None: ...
    def workspace_for(self, array_type: ArrayType) -> Any: ...


class OffloadTarget(Protocol):
    """What the scheduler needs of a network (``engine.network.Network`` has it), so offload imports
    neither the network nor the trainer: its backend, its training manager (the scheduler becomes the
    provider of ACTIVATIONS and FF_CACHE), its hook list, and its step program per batch size. Where it also
    has a planned ``arena`` (with ``host``), ``arena_types`` and ``arena_plan``, the two arenas share one region
    (``sharing``)."""

    @property
    def backend(self) -> Any: ...
    @property
    def mgr(self) -> ProviderHost: ...
    @property
    def hooks(self) -> list[Any]: ...
    def program(self, batch_size: int, training: bool = True) -> StepProgram: ...


class OffloadError(RuntimeError):
    """The offload schedule cannot go on (an IO thread failed, or the network did what the plan did not expect)."""


class OffloadDiskFault(OffloadError, DiskFaultError):
    """The swap file's disk failed under a step: an OffloadError to the scheduler's callers, and a
    ``UserError`` (one line, no traceback) to the command line."""


class UnitRegion:
    """Stands in for a workspace for one unit's tensors: open while the unit is in memory.

    The kernel table compares a tensor's generation with ``live_generation``; closing the region
    (CLOSED) when the unit leaves memory turns a use of swapped data into a clear error.
    """

    def __init__(self, name: str):
        self.name = f"offload:{name}"
        self.generation = 0
        self.live_generation = CLOSED

    def open(self, generation: int) -> None:
        self.generation = generation
        self.live_generation = generation

    def close(self) -> None:
        self.live_generation = CLOSED


@dataclass
class StepStats:
    """What one training step cost the scheduler; one line of the memory monitor's ``swap`` field."""

    step: int
    window: int
    forward_backward_s: float = 0.0  # executor wall time from iteration start to end
    offload_s: float = 0.0  # saver busy time
    onload_s: float = 0.0  # loader busy time
    offload_cpu_s: float = 0.0  # CPU the saver used (checksums, system calls): taken from the kernels' cores
    onload_cpu_s: float = 0.0
    stall_s: float = 0.0  # executor waiting (loads + room)
    load_wait_s: float = 0.0
    room_wait_s: float = 0.0
    peak_resident_bytes: int = 0
    peak_resident_units: int = 0
    peak_in_flight_bytes: int = 0
    peak_swapped_bytes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    bound_bytes: int = 0  # the plan's arena: resident bytes never exceed it
    page_cache_bytes: int = -1  # of the swap file, sampled at the start of the backward (-1: not sampled)
    lead_steps: int = 0  # the longest lookahead (timeline steps) the loader used; N unless "auto" predicted more
    read_bandwidth_bps: float = 0.0  # bytes read / loader busy time this step
    recompute_s: float = 0.0  # executor time rebuilding recomputed units (instead of reading them)
    recomputed_bytes: int = 0
    # swapped bytes the executor checks itself (``_FusedCheck``): summed by the forward that reads
    # them, verified by the rebuild that reads them back; the IO threads do not hash them
    executor_checked_bytes: int = 0
    offload_cpu_us_per_mib: float = 0.0  # the saver's CPU per MiB written (cpu_per_mib)
    onload_cpu_us_per_mib: float = 0.0  # the loader's CPU per MiB read

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepTotals:
    """Sums and peaks of ``StepStats`` over every step added, exact however long the run.

    The per-step ``History`` keeps only the latest 1,024 steps (issue 14: a long run must not grow);
    figures over the whole run are kept here as running values instead. Before, the training summary
    averaged ``stats[1:]`` and every offload run past 1,024 steps crashed at its end with an IndexError
    and lost its ``--save`` (issue 31). ``window_changes`` is bounded too: the first
    ``WINDOW_CHANGES_KEPT`` changes and the latest one, with ``window_changes_total`` counting all.
    """

    WINDOW_CHANGES_KEPT = 32

    steps: int = 0
    stall_s: float = 0.0
    io_cpu_s: float = 0.0
    bytes_written: int = 0
    bytes_read: int = 0
    peak_resident_bytes: int = 0
    bound_bytes: int = 0
    page_cache_bytes: int = -1  # the most sampled; -1 while none was sampled
    window_changes: list[tuple[int, int]] = field(default_factory=list)  # (step, window), first kept ones
    window_changes_total: int = 0
    last_window_change: tuple[int, int] | None = None

    def add(self, s: StepStats) -> None:
        if self.last_window_change is None or s.window != self.last_window_change[1]:
            self.last_window_change = (s.step, s.window)
            self.window_changes_total += 1
            if len(self.window_changes) < self.WINDOW_CHANGES_KEPT:
                self.window_changes.append(self.last_window_change)
        self.steps += 1
        self.stall_s += s.stall_s
        self.io_cpu_s += s.offload_cpu_s + s.onload_cpu_s
        self.bytes_written += s.bytes_written
        self.bytes_read += s.bytes_read
        self.peak_resident_bytes = max(self.peak_resident_bytes, s.peak_resident_bytes)
        self.bound_bytes = max(self.bound_bytes, s.bound_bytes)
        self.page_cache_bytes = max(self.page_cache_bytes, s.page_cache_bytes)

    def changes(self) -> list[tuple[int, int]]:
        """The window changes kept: the first ones, and the latest if it was not among them."""
        if self.last_window_change is not None and self.window_changes_total > len(self.window_changes):
            return [*self.window_changes, self.last_window_change]
        return list(self.window_changes)


@dataclass
class _Unit:
    """Run-time state of one unit in the current step."""

    plan: UnitPlan
    region: UnitRegion
    state: LayerState = LayerState.RELEASED
    vacated: list[bool] = field(default_factory=lambda: [False, False])
    # device event per occupation, recorded on the executor's stream when the executor vacated it: on a
    # GPU the host runs ahead of the stream, so a load into these bytes must wait for the kernels that
    # were queued to read them (None on the cpu backend, and for bytes a save vacated: its copy synced)
    vacated_event: list[Any] = field(default_factory=lambda: [None, None])
    # per occupation: the copies (device -> host, of saves that vacated earlier occupants' bytes) the
    # executor's stream must wait for before it writes these bytes (creating or rebuilding the unit)
    copy_waits: list[list[Any]] = field(default_factory=lambda: [[], []])
    copied: Any = None  # device event of this unit's save copy (a load from pinned memory waits for it)
    created: int = 0  # tensors created so far this step
    # per occupation: earlier occupants of its bytes not yet vacated (0: it may move in; ``_room_free``)
    blocked: list[int] = field(default_factory=lambda: [0, 0])
    event: Any = None  # device event: data complete (after forward) or loaded (before backward)

    @property
    def spec(self) -> UnitSpec:
        return self.plan.spec


@dataclass(frozen=True)
class _FusedCheck:
    """A swapped tensor that the executor checks itself instead of the IO threads hashing it.

    The source of a ReLU rebuild (a batch norm's output, ``plan.recompute_candidates``) is read by
    the ReLU's forward and, once loaded back, by the rebuild before anything else reads it. Both
    passes sum its 32-bit words as they read them (``kernels.cpu.elementwise.relu*_forward_checksum``:
    the same bits as the layer's kernel, plus the word sums of the input, at no extra cost: the
    pass is memory bound); the forward's through the layer's ``forward_with_input_check``. A
    mismatch is the same error as the storage's, naming the layer and the tensor. Full verify mode,
    cpu backend only.
    """

    rebuilt: tuple[int, str]  # the recomputed unit whose rebuild reads the source
    source: tuple[int, str]  # the swapped unit holding the source tensor
    tensor: TensorSpec  # the source tensor
    forward_step: int  # the ReLU's node (its forward takes the first sum)
    rebuild: Callable[[np.ndarray, np.ndarray], tuple[int, int]]  # the fused ReLU + sum kernel


def fused_checks(plan: OffloadPlan, layers: list[Any]) -> dict[tuple[int, str], _FusedCheck]:
    """Per recomputed unit of ``plan``, the check the executor does for its source (``_FusedCheck``):
    a one-node ReLU/ReLU6 rebuild from one float32 tensor of a swapped unit that no backward reads
    before the rebuild, and that no other rebuild reads, by a layer object that runs at that node only
    (its forward stores the sum for this source)."""
    from kernels.cpu.elementwise import relu6_forward_checksum, relu_forward_checksum

    kernels = {"relu_forward": relu_forward_checksum, "relu6_forward": relu6_forward_checksum}
    found: dict[tuple[int, str], _FusedCheck] = {}
    readers: dict[tuple[int, str], int] = {}
    nodes_of: dict[int, int] = {}
    for layer in layers:
        nodes_of[id(layer)] = nodes_of.get(id(layer), 0) + 1
    for unit in plan.units.values():
        for key in (unit.recompute.source_units if unit.recompute is not None else ()):
            readers[key] = readers.get(key, 0) + 1
    for unit in plan.units.values():
        recompute = unit.recompute
        if recompute is None or len(recompute.nodes) != 1 or len(recompute.sources) != 1:
            continue
        (source_key, tensor), = recompute.sources
        source = plan.units.get(source_key)
        layer = layers[recompute.nodes[0]]
        kernel = kernels.get(getattr(layer, "forward_op", None))
        if (kernel is None or not hasattr(layer, "forward_with_input_check") or nodes_of[id(layer)] != 1
                or source is None or not source.offloaded or readers[source_key] != 1 or tensor.dtype != np.float32
                or unit.load_at is None or source.spec.backward_start is None
                or source.spec.backward_start < unit.load_at):
            continue
        found[unit.key] = _FusedCheck(unit.key, source_key, tensor, recompute.nodes[0], kernel)
    return found


def cpu_per_mib(cpu_s: float, nbytes: int) -> float:
    """Microseconds of IO-thread CPU per MiB moved (0 when nothing moved): the figure issue 11 tracks.

    On two cores every microsecond here is taken from a kernel's parallel half.
    """
    return 1e6 * cpu_s / (nbytes / 2**20) if nbytes > 0 else 0.0


def step_arena_tensors(net: Any, batch_size: int) -> tuple[list[StepTensor], int] | None:
    """What the network's planned arena holds while a scheduler provides ACTIVATIONS and FF_CACHE: its tensors
    (offsets, moments) and planned peak at ``batch_size``; None where no region is shared (a device backend, no
    arena). One home for what ``OffloadScheduler`` places its units around and ``planned_peaks`` predicts."""
    arena = getattr(net, "arena", None)
    if arena is None or net.backend.is_device or not hasattr(arena, "host"):
        return None
    plan = net.arena_plan(batch_size, [t for t in net.arena_types if t not in OFFLOADED_TYPES])
    return [StepTensor(t.offset, align(t.nbytes), t.first, t.last) for t in plan.tensors], int(plan.planned_peak)


class OffloadScheduler:
    """Network hook + memory provider that swaps layer windows to disk (module docstring)."""

    def __init__(
        self,
        backend: Any,
        window: int | str = 4,
        *,
        budget_bytes: int | None = None,
        directory: str | None = None,
        delay: DelayHook | None = None,
        min_window: int = 1,
        initial_window: int | None = None,
        shrink_after: int = 2,
        sample_page_cache: bool = False,
        verify: str = "full",
        recompute: bool = True,
        predict_leads: bool | None = None,
        executor_checks: bool = True,
        io_cpus: str | Iterable[int] | None = "auto",
        history: int = 1024,
        host_swap_bytes: int | str | None = "auto",
        share_arena: bool = True,
    ):
        if verify not in VERIFY_MODES:
            raise ValueError(f"--offload-verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        if window != "auto" and window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"offload window must be a positive number of layers or 'auto', got {window!r}")
        if window is None and budget_bytes is None:
            raise ValueError("offload needs a window (--offload-n N|auto) or a byte budget (--offload-budget)")
        self.backend = backend
        self.adaptive = window == "auto"
        # start a load as early as its predicted time needs (docstring): auto's, a fixed N's only if asked
        self.predict_leads = self.adaptive if predict_leads is None else bool(predict_leads)
        self.requested_window = window
        self.budget_bytes = budget_bytes
        self.directory = directory
        self.delay = delay
        self.min_window = max(1, int(min_window))
        self.shrink_after = max(1, int(shrink_after))
        self.sample_page_cache = sample_page_cache
        self.verify = verify
        self.recompute = recompute  # rebuild what the plan allows instead of swapping it (plan.recompute_candidates)
        # check the sources of ReLU rebuilds in the ReLU's forward and the rebuild (_FusedCheck), not the IO threads
        self.executor_checks = executor_checks
        # where the saver and the loader run: "auto" keeps them off the CPUs taking the swap disk's
        # interrupts (engine.offload.affinity, measured there), None leaves them alone, or these CPUs
        if not (io_cpus is None or io_cpus == "auto"):
            io_cpus = frozenset(int(cpu) for cpu in io_cpus)
        self.requested_io_cpus = io_cpus
        # a device run's swap tier: pinned host memory up to this many bytes, the disk past it (None or 0:
        # always the disk; "auto": half the host memory the run may use, ``host_swap_limit``)
        self.host_swap_bytes = host_swap_bytes
        # one region for the units and the step arena's tensors (``plan.place_around``), on the cpu backend
        self.share_arena = share_arena
        self._hosted: Any = None  # the network's PlannedArena whose block is the start of our arena
        self.shared_region = False  # whether it ever hosted one (``sharing``)
        self._layouts: dict[int, tuple[OffloadPlan, SharedLayout]] = {}  # per plan: its units placed around the step
        self._step_plans: dict[int, tuple[SharedLayout, Any, Any]] = {}  # per layout: the step arena's plan in it
        self._step_tensors: tuple[Any, list[StepTensor], int] | None = None  # (program, tensors, step bytes)
        self._gates: dict[tuple[tuple[int, str], int], int] = {}  # the current layout's (SharedLayout)
        self._waits: dict[int, tuple[tuple[tuple[int, str], int], ...]] = {}
        self._inline = False  # the executor queues the copies itself (pinned tier: staging.DeviceStaging.inline)
        self._issue_cursor = 0  # inline: the next unit of the load order whose copy is not queued yet
        self.io_cpus: frozenset[int] | None = None  # the CPUs the IO threads were restricted to, if any
        self._recompute: dict[tuple[int, str], Recompute] = {}
        self._layers: list[Any] = []
        self._recompute_order: list[_Unit] = []
        self._bandwidth: float | None = None  # bytes/s the loader read at, averaged over steps (auto)
        self._step_times: dict[int, float] = {}  # executor seconds per timeline step, last step (auto)
        self._lead: dict[tuple[int, str], int] = {}  # per unit: steps before load_at that its load starts
        self._last_advance = 0.0
        self._recompute_cursor = 0
        self._fused: dict[tuple[int, str], _FusedCheck] = {}  # by rebuilt unit (the current plan's)
        self._summing_layers: list[Any] = []  # the ReLUs whose forward_with_input_check is ours
        self._fused_for: dict[int, tuple[OffloadPlan, dict[tuple[int, str], _FusedCheck]]] = {}  # per plan
        self._sums: dict[tuple[int, str], tuple[int, int]] = {}  # source unit -> its sum this step

        if self.adaptive:
            self.window = max(self.min_window, int(initial_window or self.min_window))
        else:
            self.window = self.min_window if window is None else int(window)
        self.max_window: int | None = None
        self.stats: History[StepStats] = History(history)  # the latest steps; len() counts all (issue 14)
        self.totals = StepTotals()  # every step, exact (the training summary's figures)
        self.steady_totals = StepTotals()  # every step after the first (the first plans and warms the file)
        self.storage: SwapStorage | None = None
        self.net: OffloadTarget | None = None
        self.mgr: ProviderHost | None = None

        self._cond = threading.Condition()
        self._program_for: Callable[[int], StepProgram] | None = None  # batch size -> the training program
        self._node_names: list[str] = []
        self._plans: dict[tuple[int, int, bool], OffloadPlan] = {}  # (batch size, window, filled) -> plan
        self._batch_size: int | None = None
        self._unit_specs: list[UnitSpec] = []
        self._creations: dict[int, list[tuple[tuple[int, str], TensorSpec]]] = {}
        self._steps = 0
        self._plan: OffloadPlan | None = None
        self._placed: OffloadPlan | None = None  # the plan's units at their offsets in our arena (``layout``)
        self._units: dict[tuple[int, str], _Unit] = {}
        self._by_forward_end: dict[int, list[_Unit]] = {}
        self._by_backward_end: dict[int, list[_Unit]] = {}
        self._regions: dict[tuple[int, str], UnitRegion] = {}
        # per plan: who waits on whom (``_blockers``); the current plan's successors
        self._links: dict[int, tuple[OffloadPlan, dict, dict]] = {}
        self._successors: dict[tuple[tuple[int, str], int], list[tuple[tuple[int, str], int]]] = {}
        self._arena: Any = None
        self._arena_map: mmap.mmap | None = None
        self._arena_capacity = 0
        self._arena_touched = 0
        self._transfer: Any = None
        self._staged0 = self._step_staged = self._replay_staged = 0  # staged bytes: a step's, the captured step's
        self._replay_stats: StepStats | None = None  # the captured step's figures, which each replay repeats

        self._generation = 0
        self._in_iteration = False
        self._needs_plan = True
        self._t = -1  # the executor's position on the timeline
        self._load_cursor = 0
        self._load_order: list[_Unit] = []
        self._error: BaseException | None = None
        self._closed = False
        # Who waits on the condition, so the executor wakes a thread only when its wait can end (the
        # executor changes state ~250 times a step; most changes end no wait).
        self._executor_waiting = False
        self._loader_ready: Callable[[], bool] | None = None  # the loader's wait condition while it waits
        self.wait_timeouts = 0  # waits that ended by their 1 s timeout, not a wake-up: a missed notify
        self._saves_pending = 0
        self._load_jobs_pending = 0
        self._current: StepStats | None = None
        self._step_started = 0.0
        self._quiet_steps = 0
        self._resident_bytes = 0
        self._resident_units = 0
        self._in_flight_bytes = 0
        self._swapped_bytes = 0
        self._io_busy = {"saver": 0.0, "loader": 0.0, "saver_cpu": 0.0, "loader_cpu": 0.0}

        self._save_queue: queue.Queue = queue.Queue()
        self._load_queue: queue.Queue = queue.Queue()
        self._saver = threading.Thread(target=self._saver_loop, name="engine-offload-saver", daemon=True)
        self._loader = threading.Thread(target=self._loader_loop, name="engine-offload-loader", daemon=True)
        self._saver.start()
        self._loader.start()

    @property
    def io_thread_ids(self) -> frozenset[int]:
        """The saver's and the loader's native thread ids (per-thread CPU figures tell them apart)."""
        return frozenset(t.native_id for t in (self._saver, self._loader) if t.native_id is not None)

    # -- wiring ----------------------------------------------------------------------------------

    def attach(self, net: OffloadTarget, batch_size: int | None = None) -> OffloadScheduler:
        """Become ``net``'s hook and the provider of its training ACTIVATIONS and FF_CACHE.

        With ``batch_size`` the plan, the arena and the swap file are made now, so a full disk or an
        unwritable directory is an error before the first step; otherwise at the first step.
        """
        if self.net is not None:
            raise OffloadError("this OffloadScheduler is already attached to a network")
        self.net = net
        self.mgr = net.mgr
        self._program_for = net.program
        net.hooks.append(self)
        self.mgr.set_provider(set(OFFLOADED_TYPES), self)
        arena = getattr(net, "arena", None)
        if (self.share_arena and self.budget_bytes is None and not self.adaptive and not self.backend.is_device
                and arena is not None and hasattr(arena, "host")):  # ``sharing``: why these conditions
            arena.host = self  # its block is the start of ours from its next iteration (shared_block)
            self._hosted = arena
            self.shared_region = True  # stays after detach: what the run did (the training summary's words)
        if batch_size is not None:
            self.prepare(batch_size)
        return self

    def detach(self) -> None:
        if self.net is None:
            return
        if self in self.net.hooks:
            self.net.hooks.remove(self)
        if not self.mgr.closed:
            for array_type in OFFLOADED_TYPES:
                if self.mgr.provider_for(array_type) is self:
                    self.mgr.set_provider(array_type, None)
        self._stop_summing()
        if self._hosted is not None:
            self._hosted.host = None  # its own block again from its next iteration
            self._hosted = None
        self.net = None

    def close(self) -> None:
        """Stop the IO threads, detach from the network, remove the swap directory, release the arena."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._generation += 1  # whatever is queued belongs to a dead step now
            self._cond.notify_all()
        self._save_queue.put(None)
        self._load_queue.put(None)
        for thread in (self._saver, self._loader):
            if thread is not threading.current_thread():
                thread.join(timeout=30)
        self.detach()
        for region in self._regions.values():
            region.close()
        if self.storage is not None:
            self.storage.close()
        if self._arena_map is not None:
            self._arena_map.madvise(mmap.MADV_DONTNEED)  # return the pages now; views may outlive us
        self._arena = None

    def __enter__(self) -> OffloadScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- planning --------------------------------------------------------------------------------

    def plan_for(self, batch_size: int, window: int | None = None, *, fill: bool = True) -> OffloadPlan:
        """The plan for this network at ``batch_size`` and ``window`` (cached).

        With a byte budget, what the window's arena leaves of it keeps swapped units resident
        (``plan.keep_within``); ``fill=False``: the window's plan alone (what the budget is checked on).
        """
        window = self.window if window is None else window
        if self._batch_size != batch_size or not self._unit_specs:  # what create() checks against, too
            program = self._program_for(batch_size)
            self._unit_specs, self._creations, self._steps = program_units(program)
            self._node_names = list(program.node_names)
            self._recompute = recompute_candidates(program, self._unit_specs) if self.recompute else {}
            self._layers = [node.layer for node in program.graph.nodes]  # what a recompute runs
            self._batch_size = batch_size
        key = (batch_size, window, fill and self.budget_bytes is not None)
        if key not in self._plans:
            self._plans[key] = build_plan(self._unit_specs, window, self._steps, self._recompute,
                                          self.budget_bytes if key[2] else None)
        return self._plans[key]

    def _window_plan(self, batch_size: int) -> Callable[[int], OffloadPlan]:
        """Window -> the window's own plan (cached, no units kept for the budget): what budgets are checked on."""
        return lambda window: self.plan_for(batch_size, window, fill=False)

    def prepare(self, batch_size: int) -> OffloadPlan:
        """Plan for ``batch_size``, size the arena, create the swap file (free-space check included)."""
        if self._program_for is None:
            raise OffloadError("attach(net) before prepare()")
        plan = self.plan_for(batch_size, self.min_window, fill=False)
        if self.budget_bytes is not None:
            fixed = None if self.adaptive or self.requested_window is None else self.window
            refusal = budget_refusal(self._unit_specs, self._window_plan(batch_size), self.budget_bytes, fixed,
                                     self.min_window, batch_size)
            if refusal is not None:
                raise OffloadError(refusal)
        if self.adaptive or self.requested_window is None:
            self.max_window = largest_window(self._unit_specs, self._window_plan(batch_size), self.budget_bytes,
                                             self.min_window)
        else:
            self.max_window = self.window
        if self.requested_window is None:  # a byte budget alone: N=4 (or less to fit), the rest keeps units
            self.window = min(BUDGET_WINDOW, self.max_window)
        elif self.adaptive:
            self.window = min(self.window, self.max_window)
            if self.budget_bytes is not None:
                # Under a budget, auto stays at the budget's window or above. Below it, the saver's lag is
                # what the executor waits for (room), and growing back writes more (``_growing_helps``):
                # MobileNetV2 batch 32 with 0.3x settled at N=1, stall 36.8 ms, 1.303x, against N=4's
                # 0.5 ms and 1.246x; ResNet-18 at N=2, stall 21.9 ms.
                self.window = max(self.window, self._floor)
        # Room for the largest window this run may use (pages are touched only as the window needs them);
        # with a budget, any window's plan fills it up to the budget (and never past every unit's bytes).
        step = self._step_part(batch_size)  # sharing: the step arena's bytes come first (untouched pages cost nothing)
        if self.adaptive and self.budget_bytes is not None:
            self._ensure_arena(step + min(self.budget_bytes, plan.total_bytes))
        else:
            widest = self.plan_for(batch_size, self.max_window if self.adaptive else self.window)
            self._ensure_arena(step + widest.arena_bytes)
        if self._transfer is None:
            self._transfer = transfer_for(self.backend, max(u.footprint for u in self._unit_specs))
        self._ensure_file(self.plan_for(batch_size).file_bytes_used)  # what the starting window writes
        log.info("offload plan: batch %d, window %s (max %d), arena %s (no offload: %s), swap file %s",
                 batch_size, "auto" if self.adaptive else self.window, self.max_window,
                 format_bytes(self.plan_for(batch_size).arena_bytes), format_bytes(plan.total_bytes),
                 format_bytes(plan.file_bytes))
        return self.plan_for(batch_size)

    def _place_io_threads(self) -> None:
        """Restrict the saver and the loader to ``io_cpus`` ("auto": off the swap disk's interrupt CPUs)."""
        wanted = self.requested_io_cpus
        if wanted == "auto":
            wanted = io_thread_cpus(str(self.storage.file_path))
        if wanted is not None and pin_threads(self.io_thread_ids, wanted):
            self.io_cpus = wanted
            log.info("offload: IO threads on CPUs %s", ",".join(map(str, sorted(wanted))))

    # -- one region with the step arena (plan.place_around) ----------------------------------------

    def _step_part(self, batch_size: int) -> int:
        """The step arena's bytes at the region's start when the arena is shared (0 when not)."""
        found = self._step_arena(batch_size) if self.sharing else None
        return 0 if found is None else -(-found[1] // PAGE) * PAGE

    def _step_arena(self, batch_size: int) -> tuple[list[StepTensor], int] | None:
        """The hosted step arena's tensors and planned peak at ``batch_size`` (None: not shared); per program."""
        if self._hosted is None or self.net is None:
            return None
        program = self._program_for(batch_size)
        cached = self._step_tensors
        if cached is None or cached[0] is not program:
            found = step_arena_tensors(self.net, batch_size)
            if found is None:
                return None
            cached = self._step_tensors = (program, found[0], found[1])
        return cached[1], cached[2]

    @property
    def sharing(self) -> bool:
        """Whether the units share one region with the step arena: on the cpu backend, with a fixed window and no
        byte budget (a budget counts the units' own arena: ``keep_within`` fills it, ``largest_window`` grows the
        window into it; ``engine.offload.budget`` runs ``auto`` at its floor as N=1 without one, shared)."""
        return self._hosted is not None

    def layout(self, plan: OffloadPlan) -> SharedLayout | None:
        """``plan``'s units placed around the hosted step arena's tensors (cached); None when not shared."""
        if not self.sharing:
            return None
        found = self._step_arena(self._batch_size) if self._batch_size is not None else None
        if found is None:
            return None
        cached = self._layouts.get(id(plan))
        if cached is None or cached[0] is not plan or cached[1].own_step_bytes != found[1]:
            cached = self._layouts[id(plan)] = (plan, place_around(plan, found[0], found[1]))
        return cached[1]

    def step_plan(self, batch_size: int, own: Any) -> Any:
        """The hosted step arena's plan in the region (``PlannedArena.host``): ``own`` (its plan alone, an
        ``ArenaPlan``) with the offsets the layout of this step's plan gave its tensors, or ``own`` where the layout
        kept them (the same object for the same layout: the arena rebuilds its slots only when it changes)."""
        if self._batch_size != batch_size or self.max_window is None or self._arena is None:
            self.prepare(batch_size)
        layout = self.layout(self.plan_for(batch_size))
        if layout is None or layout.step_offsets is None:
            return own
        cached = self._step_plans.get(id(layout))
        if cached is None or cached[0] is not layout or cached[1] is not own:
            tensors = [dataclasses.replace(t, offset=o) for t, o in zip(own.tensors, layout.step_offsets)]
            placed = dataclasses.replace(own, tensors=tensors, planned_peak=layout.step_bytes)
            cached = self._step_plans[id(layout)] = (layout, own, placed)
        return cached[2]

    def shared_block(self, nbytes: int) -> Any:
        """The step arena's block (``PlannedArena.host``): the first ``nbytes`` of our arena, which ``step_plan``
        prepared for this batch size just before (the arena must not move after the step arena took its block)."""
        self._ensure_arena(nbytes)
        return self._arena[:nbytes]

    def _wait_for_step_bytes(self, moment: int) -> None:
        """Before the step arena makes the tensors of ``moment``: the units that held their bytes have left them."""
        pending = self._waits.get(moment)
        if not pending or self._needs_plan:
            return
        units = self._units
        with self._cond:
            self._current.room_wait_s += self._wait_for(lambda: all(units[k].vacated[i] for k, i in pending))

    def _ensure_arena(self, nbytes: int) -> None:
        nbytes = max(int(nbytes), 64)
        if self._arena is not None and self._arena_capacity >= nbytes:
            return
        if self.backend.is_device:
            self._arena = self.backend.alloc_block(nbytes)
        else:  # an anonymous mapping: pages we stop using can be handed back to the OS (madvise)
            self._arena_map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # 2 MiB pages, as NumPy asks for the workspaces' blocks: O_DIRECT pins fewer pages and
                # the kernels miss the TLB less. ResNet-18 batch 32, N=4, engine bench, three
                # alternating runs each: IO threads' CPU 27-29 -> 21 ms per step, step ratio
                # 1.106-1.126x -> 1.089-1.112x.
                self._arena_map.madvise(mmap.MADV_HUGEPAGE)
            self._arena = np.frombuffer(self._arena_map, dtype=np.uint8)
        self._arena_capacity = nbytes
        self._arena_touched = 0

    def _use_plan(self, plan: OffloadPlan) -> None:
        """Switch to ``plan`` (between steps: no tensor of the old one is alive); with the step arena hosted, to
        its layout around the step's tensors (``layout``)."""
        layout = self.layout(plan)
        placed = plan if layout is None else layout.plan  # the units' offsets (in the region, when shared)
        self._gates, self._waits = ({}, {}) if layout is None else (layout.gates, layout.waits)
        self._ensure_arena(placed.arena_bytes)
        self._plan = plan  # the units' own plan: what the reports and the budget read
        self._placed = placed
        self._units = {}
        for key, unit_plan in placed.units.items():
            region = self._regions.get(key)
            if region is None:
                region = self._regions[key] = UnitRegion(unit_plan.spec.label)
            self._units[key] = _Unit(unit_plan, region)
        self._by_forward_end = {}
        self._by_backward_end = {}
        for unit in self._units.values():
            self._by_forward_end.setdefault(unit.spec.forward_end, []).append(unit)
            if unit.plan.offloaded or unit.spec.backward_start is not None:
                self._by_backward_end.setdefault(unit.spec.backward_end, []).append(unit)
        counts, self._successors = self._blockers(placed)
        for key, unit in self._units.items():
            unit.blocked = [counts.get((key, 0), 0), counts.get((key, 1), 0)]
        self._load_order = [self._units[u.key] for u in plan.load_order]
        self._recompute_order = [self._units[u.key] for u in plan.recomputed]
        self._use_fused_checks(plan)
        if self._arena_map is not None and self._arena_touched > placed.arena_bytes:
            start = (placed.arena_bytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
            if start < self._arena_capacity:  # the window shrank: give the tail's pages back
                self._arena_map.madvise(mmap.MADV_DONTNEED, start, self._arena_capacity - start)
        self._arena_touched = placed.arena_bytes

    def _use_fused_checks(self, plan: OffloadPlan) -> None:
        """The checks the executor does itself under ``plan`` (``_FusedCheck``), handed to the storage."""
        fused: dict[tuple[int, str], _FusedCheck] = {}
        if (self.executor_checks and self.verify == "full" and getattr(self.backend, "name", None) == "cpu"
                and self.storage is not None):
            cached = self._fused_for.get(id(plan))
            if cached is None or cached[0] is not plan:
                cached = self._fused_for[id(plan)] = (plan, fused_checks(plan, self._layers))
            fused = cached[1]
        self._fused = fused
        self._stop_summing()
        for check in fused.values():
            layer = self._layers[check.forward_step]
            layer.forward_with_input_check = functools.partial(self._forward_and_sum, check)
            self._summing_layers.append(layer)
        if self.storage is not None:
            self.storage.check_elsewhere(frozenset(plan.units[c.source].file_offset + c.tensor.offset
                                                   for c in fused.values()))

    def _stop_summing(self) -> None:
        for layer in self._summing_layers:
            layer.forward_with_input_check = None
        self._summing_layers = []

    def _forward_and_sum(self, check: _FusedCheck, x: Tensor, out: Tensor) -> None:
        """The ReLU's training forward (``forward_with_input_check``): its kernel fused with the sum of
        its input, the swapped source the rebuild will check."""
        sums = check.rebuild(x.kernel_array(FUSED_OP, "x"), out.kernel_array(FUSED_OP, "out"))
        if self._in_iteration and not self._needs_plan:
            self._sums[check.source] = sums
            self._current.executor_checked_bytes += check.tensor.nbytes

    def _blockers(self, plan: OffloadPlan) -> tuple[dict, dict]:
        """Per occupation, how many earlier occupants of its bytes there are, and per occupation,
        the later ones waiting for it to leave (the plan's ``predecessors``, inverted; cached).

        ``_room_free`` was a loop over every earlier occupant of the bytes, run on the executor at
        each unit it creates and, while the loader waits, at every state change (the loader's
        condition): MobileNetV2 batch 32, N=4, ~230 checks per step over 23 predecessors on average
        (up to 176), ~3 ms of the executor's Python per step under cProfile. Counting them down as
        each leaves (``_vacate``: 5,628 decrements per step in all) makes the check one comparison.
        The step time did not move beyond this machine's noise (a few ms in ~400).
        """
        links = self._links.get(id(plan))
        if links is None or links[0] is not plan:
            counts: dict[tuple[tuple[int, str], int], int] = {}
            successors: dict[tuple[tuple[int, str], int], list[tuple[tuple[int, str], int]]] = {}
            for span, earlier in plan.predecessors.items():
                counts[span] = len(earlier)
                for before in earlier:
                    successors.setdefault(before, []).append(span)
            links = self._links[id(plan)] = (plan, counts, successors)
        return links[1], links[2]

    # -- the provider ----------------------------------------------------------------------------

    def create(self, array_type: ArrayType, shape: tuple[int, ...], dtype: np.dtype, owner: Any) -> Tensor:
        """``mgr.create`` for ACTIVATIONS and FF_CACHE: a view into the arena at the planned offset."""
        if owner is None or not self._in_iteration:  # the loss head, or outside a training step
            workspace = self.mgr.workspace_for(array_type)
            return workspace.create(shape, dtype, array_type)
        self._raise_if_failed()
        if self._needs_plan:
            self._begin_planned_step(shape)
        creations = self._creations.get(owner, ())
        unit_key = None
        tensor_spec = None
        sequence = self._created_by_owner.get(owner, 0)
        if sequence < len(creations):
            unit_key, tensor_spec = creations[sequence]
        if (tensor_spec is None or tensor_spec.array_type is not array_type or tensor_spec.shape != tuple(shape)
                or tensor_spec.dtype != np.dtype(dtype)):
            node = self._node_names[owner] if 0 <= owner < len(self._node_names) else owner
            expected = (f"{tensor_spec.array_type.name} {tensor_spec.shape} {tensor_spec.dtype}"
                        if tensor_spec is not None else "nothing more")
            raise OffloadError(
                f"layer {node!r} created {array_type.name} {tuple(shape)} {np.dtype(dtype)} as its tensor "
                f"#{sequence}, but the offload plan (from the step program, engine.program) expected {expected}: "
                f"the layer's saved_specs/output_shape disagree with what it allocates"
            )
        self._created_by_owner[owner] = sequence + 1
        unit = self._units[unit_key]
        if unit.created == 0:
            self._move_in_for_forward(unit)
        unit.created += 1
        start = unit.plan.arena_offset + tensor_spec.offset
        view = self._arena[start:start + tensor_spec.nbytes].view(tensor_spec.dtype).reshape(tensor_spec.shape)
        return Tensor(view, array_type, unit.region, self._generation, start)

    def _ensure_file(self, nbytes: int) -> None:
        """A swap file of at least ``nbytes`` (at least one page), created or grown between two steps.

        Sized for the plan in use, not for every unit: a budget that keeps every unit writes nothing and
        needs no file, and a window auto grows to writes no more. A window that writes past the file
        (auto shrinking under a budget) gets a larger one before its step: between steps nothing on disk
        is needed any more, so the old file is dropped, and a disk too full for the new one is an error
        between two steps (engine.guard saves the last step's checkpoint)."""
        if self.storage is not None and self.storage.capacity_bytes < nbytes:
            self.storage.close()
            self.storage = None
        if self.storage is None:
            self.storage = self._transfer.make_storage(nbytes, self.directory, self.delay, self.verify,
                                                       self.host_swap_limit())
            self._written0 = self._read0 = 0  # this step's IO counts from the new file's zero
            if self.storage.file_path is not None:
                self._place_io_threads()
        self._inline = self._transfer.inline(self.storage)

    def host_swap_limit(self) -> int:
        """The most pinned host memory a device run swaps into before it uses the disk.

        ``"auto"``: half of what the run may use of the host (``engine.memory.limits.memory_limit``:
        available RAM, the cgroup's limit, ``ulimit -v``), read when the swap tier is made. On a GPU
        the memory that is short is the device's; the host's RAM is usually many times larger and a
        PCIe copy of the step's swapped bytes takes a few ms where the disk took tens (the H200's
        ResNet-18 batch 32: 86 MB each way per step). Half, not all: the data pipeline, the
        checkpoint and other processes need the rest, and pinned pages cannot be swapped out.
        """
        wanted = self.host_swap_bytes
        if not wanted or getattr(self.backend, "name", None) not in ("cuda", "cudasim"):
            return 0
        if wanted == "auto":
            from engine.memory.limits import memory_limit

            try:
                return memory_limit().bytes // 2
            except ImportError:  # psutil missing: nothing says how much the host has, so the disk
                log.warning("offload: cannot read the host's memory (psutil missing): swapping to disk")
                return 0
        return int(wanted)

    def _begin_planned_step(self, first_shape: tuple[int, ...]) -> None:
        batch_size = int(first_shape[0]) if first_shape else 1
        if self._batch_size != batch_size or self.max_window is None or self._arena is None:
            self.prepare(batch_size)
        self._ensure_file(self.plan_for(batch_size).file_bytes_used)
        self._use_plan(self.plan_for(batch_size))
        self._needs_plan = False
        self._current.window = self.window
        # the units' arena, or shared with the step's tensors the region (a unit whose save lags past its span keeps
        # bytes no one else needs then: the units alone may hold more than their own plan's arena, never the region)
        self._current.bound_bytes = self._placed.arena_bytes
        self._transfer.begin_step()
        if self._inline:  # the executor queues the loads itself, as their time and room come (_issue_loads)
            self._issue_cursor = 0
            return
        with self._cond:
            self._load_jobs_pending += 1
        self._load_queue.put((self._generation, list(self._load_order)))

    def _move_in_for_forward(self, unit: _Unit) -> None:
        """The executor is about to create the unit: wait until its bytes are free (a save may hold them)."""
        with self._cond:
            waited = self._wait_for(lambda: self._room_free(unit, 0))
            self._current.room_wait_s += waited
            self._set_state(unit, LayerState.READY_FOR_EXEC)
            unit.region.open(self._generation)
        if unit.copy_waits[0]:  # a save vacated these bytes: its copy runs before the forward overwrites them
            self._transfer.wait_copies(unit.copy_waits[0])

    # -- hooks (the executor) --------------------------------------------------------------------

    def on_iteration_start(self, net: Any = None) -> None:
        self._raise_if_failed()
        with self._cond:
            self._generation += 1  # cancels what a failed previous step left queued
            self._cond.notify_all()
        self._wait_io_idle()
        for region in self._regions.values():
            region.close()
        self._in_iteration = True
        self._needs_plan = True
        self._t = -1
        self._load_cursor = 0
        self._recompute_cursor = 0
        self._created_by_owner: dict[int, int] = {}
        self._sums = {}
        self._resident_bytes = self._resident_units = self._in_flight_bytes = self._swapped_bytes = 0
        self._io_busy = {"saver": 0.0, "loader": 0.0, "saver_cpu": 0.0, "loader_cpu": 0.0}
        self._written0 = self.storage.bytes_written if self.storage else 0
        self._read0 = self.storage.bytes_read if self.storage else 0
        self._current = StepStats(step=len(self.stats), window=self.window)
        self._staged0 = self._transfer.staged_bytes if self._transfer is not None else 0
        self._step_started = time.perf_counter()

    def before_forward(self, step: int, node: Any = None) -> None:
        self._advance(step)

    def after_forward(self, step: int, node: Any = None) -> None:
        self._end_forward(step)
        self._wait_for_step_bytes(step + 1)  # the next moment's step tensors (the loss backward's, after the last)

    def _end_forward(self, step: int) -> None:
        if self._needs_plan:
            return
        ready: list[Any] = []  # one device event for every unit this forward ends (a GPU: ~5 µs each)
        for unit in self._by_forward_end.get(step, ()):
            if unit.state is not LayerState.READY_FOR_EXEC:
                continue
            leaves = unit.plan.offloaded or unit.spec.backward_start is None or unit.plan.recompute is not None
            if leaves and not ready:
                ready.append(self._transfer.ready_event())
            if unit.plan.offloaded:
                unit.event = ready[0]
                if self._inline:
                    self._save_inline(unit)
                    continue
                with self._cond:
                    self._set_state(unit, LayerState.WAIT_FOR_OFF)
                    self._saves_pending += 1
                self._save_queue.put((self._generation, unit))
            elif unit.spec.backward_start is None or unit.plan.recompute is not None:
                # transient: nothing reads it again; recomputed: rebuilt before its backward
                self._release(unit, 0, ready[0])

    def before_backward(self, step: int, node: Any = None) -> None:
        self._advance(step)
        if self._needs_plan:
            return
        if (self._t == self._steps // 2 and self.sample_page_cache and self.storage is not None
                and self.storage.file_path is not None):
            self._current.page_cache_bytes = self.storage.page_cache_bytes()
        order = self._load_order
        while self._load_cursor < len(order) and order[self._load_cursor].plan.load_at <= step:
            unit = order[self._load_cursor]
            if self._inline and unit.state is not LayerState.READY_FOR_EXEC:
                raise OffloadError(f"layer {unit.spec.label}: its load is due at timeline step {step} but its "
                                   f"bytes in the arena are still held: the offload plan is inconsistent")
            with self._cond:
                waited = self._wait_for(lambda u=unit: u.state is LayerState.READY_FOR_EXEC)
            self._current.load_wait_s += waited
            self._transfer.wait_loaded(unit.event)
            self._load_cursor += 1
        rebuild = self._recompute_order
        while self._recompute_cursor < len(rebuild) and rebuild[self._recompute_cursor].plan.load_at <= step:
            self._rebuild(rebuild[self._recompute_cursor])
            self._recompute_cursor += 1

    def _rebuild(self, unit: _Unit) -> None:
        """Recompute a unit from its source (in memory now: loaded by ``load_at``) into its arena bytes.

        On the executor: the rebuild is one elementwise pass (a ReLU over a batch norm's output); on
        two cores a loader thread running it would take the same core from the next kernel.
        """
        recompute = unit.plan.recompute
        sources = [self._units[key] for key in recompute.source_units]
        with self._cond:
            waited = self._wait_for(lambda: all(u.state is LayerState.READY_FOR_EXEC for u in sources)
                                    and self._room_free(unit, 1))
            self._current.room_wait_s += waited
            self._set_state(unit, LayerState.READY_FOR_EXEC)
            unit.region.open(self._generation)
        if unit.copy_waits[1]:  # a save vacated these bytes: its copy runs before the rebuild overwrites them
            self._transfer.wait_copies(unit.copy_waits[1])
        started = time.perf_counter()
        check = self._fused.get(unit.spec.key)
        if check is not None:
            self._rebuild_and_check(unit, check)
        else:
            first = self._layers[recompute.nodes[0]]
            inputs = [first.saved["x"] if key == NETWORK_INPUT else self._tensor(self._units[key], tensor)
                      for key, tensor in recompute.sources]  # the network input: the first layer keeps it
            out = self._tensor(unit, recompute.tensor)
            scratch = None
            if recompute.scratch_bytes:  # the arena's tail (OffloadPlan.rebuild_scratch_offset): one rebuild at a time
                start = self._placed.rebuild_scratch_offset
                scratch = self._arena[start:start + recompute.scratch_bytes].view(np.float32)
            for node in recompute.nodes:  # the first reads the sources, later ones rewrite out in place
                self._layers[node].recompute_output(inputs, out, scratch)
                inputs = [out]
        self._current.recompute_s += time.perf_counter() - started
        self._current.recomputed_bytes += recompute.tensor.nbytes

    def _rebuild_and_check(self, unit: _Unit, check: _FusedCheck) -> None:
        """The ReLU rebuild that also sums its source, checked against the sum taken after the forward."""
        source = self._units[check.source]
        found = check.rebuild(self._view(source, check.tensor), self._view(unit, unit.plan.recompute.tensor))
        expected = self._sums.pop(check.source, None)
        if found != expected:
            where = (f" at offset {source.plan.file_offset + check.tensor.offset} of {self.storage.file_path}"
                     if self.storage is not None else "")
            if expected is None:
                raise OffloadError(f"layer {source.spec.name!r}, tensor {check.tensor.name!r}: read back before its "
                                   f"checksum was taken after the forward (the offload schedule is out of order)")
            raise OffloadDiskFault(
                f"checksum mismatch reading layer {source.spec.name!r}, tensor {check.tensor.name!r} "
                f"({check.tensor.nbytes} bytes{where}): the swap file was changed or the disk is failing; "
                f"training cannot continue with these values"
            )

    def _view(self, unit: _Unit, tensor_spec: TensorSpec) -> np.ndarray:
        start = unit.plan.arena_offset + tensor_spec.offset
        return self._arena[start:start + tensor_spec.nbytes].view(tensor_spec.dtype).reshape(tensor_spec.shape)

    def _tensor(self, unit: _Unit, tensor_spec: TensorSpec) -> Tensor:
        start = unit.plan.arena_offset + tensor_spec.offset
        view = self._arena[start:start + tensor_spec.nbytes].view(tensor_spec.dtype).reshape(tensor_spec.shape)
        return Tensor(view, tensor_spec.array_type, unit.region, self._generation, start)

    def after_backward(self, step: int, node: Any = None) -> None:
        self._end_backward(step)
        self._wait_for_step_bytes(step + 1)

    def _end_backward(self, step: int) -> None:
        if self._needs_plan:
            return
        ready: list[Any] = []  # one device event for every unit this backward ends
        for unit in self._by_backward_end.get(step, ()):
            if unit.state is LayerState.READY_FOR_EXEC:
                if not ready:
                    ready.append(self._transfer.ready_event())
                self._release(unit, len(unit.plan.occupations) - 1, ready[0])

    def on_iteration_end(self, net: Any = None) -> None:
        if self._needs_plan:  # nothing was created through us (no training forward ran)
            self._in_iteration = False
            return
        self._advance(self._steps)
        self._wait_io_idle()
        self._raise_if_failed()
        for unit in self._units.values():
            if unit.state is not LayerState.RELEASED:
                self._release(unit, len(unit.plan.occupations) - 1, self._transfer.ready_event())
        self._transfer.join()
        self._in_iteration = False
        stats = self._current
        stats.forward_backward_s = time.perf_counter() - self._step_started
        stats.offload_s = self._io_busy["saver"]
        stats.onload_s = self._io_busy["loader"]
        stats.offload_cpu_s = self._io_busy["saver_cpu"]
        stats.onload_cpu_s = self._io_busy["loader_cpu"]
        stats.stall_s = stats.load_wait_s + stats.room_wait_s
        if self.storage is not None:
            stats.bytes_written = self.storage.bytes_written - self._written0
            stats.bytes_read = self.storage.bytes_read - self._read0
        stats.lead_steps = max([self._plan.window] + [self._lead.get(u.spec.key, 0) for u in self._load_order])
        stats.read_bandwidth_bps = stats.bytes_read / stats.onload_s if stats.onload_s > 0 else 0.0
        stats.offload_cpu_us_per_mib = cpu_per_mib(stats.offload_cpu_s, stats.bytes_written)
        stats.onload_cpu_us_per_mib = cpu_per_mib(stats.onload_cpu_s, stats.bytes_read)
        self._step_staged = (self._transfer.staged_bytes if self._transfer is not None else 0) - self._staged0
        self.stats.append(stats)
        self.totals.add(stats)
        if stats.step > 0:
            self.steady_totals.add(stats)
        log.info("offload step %d: window %d, resident peak %s of %s bound (%d layers), stall %.1f ms, "
                 "written %s, read %s", stats.step, stats.window, format_bytes(stats.peak_resident_bytes),
                 format_bytes(stats.bound_bytes), stats.peak_resident_units, 1e3 * stats.stall_s,
                 format_bytes(stats.bytes_written), format_bytes(stats.bytes_read))
        if self.adaptive:
            self._adapt(stats)
        if self.predict_leads:
            self._predict_leads(stats)

    # -- a step captured as a CUDA graph (engine/cuda_graph.py) ----------------------------------------

    def capture_blocker(self) -> str | None:
        """Why a step of this scheduler cannot be one captured CUDA graph now (None: it can).

        It can when the swap tier is pinned host memory (``_inline``): every save, load and event wait is then
        queued by the executor on streams a stream capture follows, and nothing waits on the host. The disk
        tier needs the IO threads and the host's waits for copies; "auto" changes its window between steps
        from measured waits, which a replay neither has nor could follow."""
        if self.storage is None or self._transfer is None:
            return "offload has not run a step yet"
        if not self._inline:
            return f"offload swaps to the {self.storage.kind}, which needs the IO threads (pinned host memory only)"
        if self.adaptive:
            return "--offload-n auto changes the window between steps"
        if self.predict_leads:
            return "offload predicts its load leads from each step's timings"
        return None

    def graph_epoch(self) -> tuple[int, ...]:
        """What a captured graph holds addresses of: the arena, the pinned swap buffer, the plan (a new one
        moves units)."""
        buffer = getattr(self.storage, "buffer", None)
        return (id(self._arena), id(buffer), id(self._plan), self._arena_capacity)

    def capture_checkpoint(self) -> tuple[Any, ...]:
        """The per-step figures before a capture: a capture that fails after running the step's Python (a GPU's
        end_capture can) gives them back (``capture_restore``), and the step runs eagerly and counts once."""
        return (copy.deepcopy(self.stats), copy.deepcopy(self.totals), copy.deepcopy(self.steady_totals),
                self.storage.bytes_written if self.storage is not None else 0,
                self.storage.bytes_read if self.storage is not None else 0,
                self._transfer.staged_bytes if self._transfer is not None else 0)

    def capture_restore(self, state: tuple[Any, ...]) -> None:
        self.stats, self.totals, self.steady_totals, written, read, staged = state
        if self.storage is not None:
            self.storage.bytes_written, self.storage.bytes_read = written, read
        if self._transfer is not None:
            self._transfer.staged_bytes = staged

    def captured(self) -> None:
        """The step just run was captured: its Python ran once (and was counted); replays repeat its copies."""
        self._replay_stats = self.stats[-1] if self.stats else None
        self._replay_staged = self._step_staged

    def replayed(self) -> None:
        """A replay of the captured step ran on the device: the host-side figures a step keeps.

        The replay moves exactly the captured step's bytes (the graph holds its copies and their order), so
        the step's figures are the captured step's bytes and peaks: written and read bytes, the resident,
        in-flight and swapped peaks (the plan's, the same every replay), the window. The host waits nothing
        (``stall_s`` 0: a load's wait is an event inside the graph) and no IO thread works (CPU 0); its
        time is the step's on the device, not the executor's: ``forward_backward_s`` is 0. The record
        checks (``PinnedStorage.check_read``: a record read back was written this step) ran when the step
        was captured; a replay repeats that schedule exactly, so they hold again. ``_generation`` advances
        as an eager step's would."""
        captured = self._replay_stats
        if captured is None:
            raise OffloadError("an offload step replayed without a captured one")
        self._generation += 1
        stats = StepStats(step=len(self.stats), window=captured.window, bound_bytes=captured.bound_bytes,
                          peak_resident_bytes=captured.peak_resident_bytes,
                          peak_resident_units=captured.peak_resident_units,
                          peak_in_flight_bytes=captured.peak_in_flight_bytes,
                          peak_swapped_bytes=captured.peak_swapped_bytes, bytes_written=captured.bytes_written,
                          bytes_read=captured.bytes_read, lead_steps=captured.lead_steps,
                          recomputed_bytes=captured.recomputed_bytes)
        if self.storage is not None:
            self.storage.bytes_written += captured.bytes_written
            self.storage.bytes_read += captured.bytes_read
        if self._transfer is not None:
            self._transfer.staged_bytes += self._replay_staged
        self.stats.append(stats)
        self.totals.add(stats)
        if stats.step > 0:
            self.steady_totals.add(stats)

    def _predict_leads(self, stats: StepStats) -> None:
        """Per offloaded unit of the next step: how many timeline steps ahead its load must start.

        Predicted load time = unit bytes / measured read bandwidth (an average over steps, so one
        slow read does not swing it); the lead is the number of executor steps before the unit's
        ``load_at`` whose measured durations add up to that time, at least N and at most N_max.
        """
        if stats.bytes_read > 0 and stats.onload_s > 0:
            measured = stats.bytes_read / stats.onload_s
            self._bandwidth = measured if self._bandwidth is None else 0.5 * (self._bandwidth + measured)
        if self._bandwidth is None or self._batch_size is None:
            return
        plan = self.plan_for(self._batch_size)
        ceiling = max(self.window, self.max_window or self.window) if self.adaptive else self._steps // 2
        leads = {}
        for unit in plan.load_order:
            needed = unit.nbytes / self._bandwidth
            lead, elapsed = 0, 0.0
            while elapsed < needed and lead < ceiling and unit.load_at - lead - 1 >= 0:
                lead += 1
                elapsed += self._step_times.get(unit.load_at - lead, 0.0)
            leads[unit.key] = max(self.window, lead)
        self._lead = leads

    def _adapt(self, stats: StepStats) -> None:
        """Grow after a step in which the executor waited; shrink after quiet steps with idle IO threads."""
        waited = stats.stall_s > max(5e-4, 0.02 * stats.forward_backward_s)
        idle = max(stats.offload_s, stats.onload_s) < 0.5 * stats.forward_backward_s
        previous = self.window
        if waited:
            self._quiet_steps = 0
            if self.max_window is not None and self.window < self.max_window and self._growing_helps():
                self.window += 1
        elif idle:
            self._quiet_steps += 1
            if self._quiet_steps >= self.shrink_after and self.window > self._floor:
                self.window -= 1
                self._quiet_steps = 0
        else:
            self._quiet_steps = 0
        if self.window != previous:
            log.info("offload window %d -> %d (stall %.1f ms, saver busy %.1f ms, loader busy %.1f ms)",
                     previous, self.window, 1e3 * stats.stall_s, 1e3 * stats.offload_s, 1e3 * stats.onload_s)

    @property
    def _floor(self) -> int:
        """``auto``'s smallest window: ``min_window``, or under a budget the budget's window (``prepare``: why)."""
        if self.budget_bytes is None or self.max_window is None:
            return self.min_window
        return max(self.min_window, min(BUDGET_WINDOW, self.max_window))

    def _growing_helps(self) -> bool:
        """Whether a window one larger writes no more bytes than this one. Without a budget it never
        writes more. With one, the larger window's arena leaves less of the budget to keep units
        (``plan.keep_within``), so it usually writes more, and more bytes on the disk are what made
        the executor wait: growing would feed the waits it answers."""
        if self.budget_bytes is None or self._batch_size is None:
            return True
        now = self.plan_for(self._batch_size)
        return self.plan_for(self._batch_size, self.window + 1).offloaded_bytes <= now.offloaded_bytes

    def swap_report(self) -> dict[str, int]:
        """The last step's figures for the memory monitor: ``monitor.sample(step, swap=...)``."""
        if not self.stats:
            return {"window": self.window, "resident_bytes": 0, "in_flight_bytes": 0, "swapped_bytes": 0}
        s = self.stats[-1]
        return {
            "window": s.window,
            "resident_bytes": s.peak_resident_bytes,
            "in_flight_bytes": s.peak_in_flight_bytes,
            "swapped_bytes": s.peak_swapped_bytes,
            "bound_bytes": s.bound_bytes,
            "resident_units": s.peak_resident_units,
            "written_bytes": s.bytes_written,
            "read_bytes": s.bytes_read,
            "stall_ms": round(1e3 * s.stall_s, 3),
            "lead_steps": s.lead_steps,
            "recompute_ms": round(1e3 * s.recompute_s, 3),
            "recomputed_bytes": s.recomputed_bytes,
            "executor_checked_bytes": s.executor_checked_bytes,
            "offload_cpu_ms": round(1e3 * s.offload_cpu_s, 3),
            "onload_cpu_ms": round(1e3 * s.onload_cpu_s, 3),
            "offload_cpu_us_per_mib": round(s.offload_cpu_us_per_mib, 1),
            "onload_cpu_us_per_mib": round(s.onload_cpu_us_per_mib, 1),
        }

    # -- executor helpers ------------------------------------------------------------------------

    def _advance(self, step: int) -> None:
        now = time.perf_counter()
        if self.predict_leads and self._t >= 0:
            self._step_times[self._t] = now - self._last_advance
        self._last_advance = now
        with self._cond:
            self._t = step
            self._wake()
        if self._inline and not self._needs_plan:
            self._issue_loads()

    def _release(self, unit: _Unit, occupation: int, event: Any = None) -> None:
        with self._cond:
            unit.region.close()
            self._set_state(unit, LayerState.RELEASED)
            unit.vacated_event[occupation] = event
            self._vacate(unit, occupation)
            self._wake()

    def _vacate(self, unit: _Unit, occupation: int, copied: Any = None) -> None:
        """The unit left these bytes (caller holds the condition): the later occupants wait on one fewer.

        ``copied``: the event of the save's copy that vacated them (device backends); the executor's stream
        waits for it before it writes the bytes (``copy_waits``), a load's copy stream through ``after``.
        """
        if unit.vacated[occupation]:
            return
        unit.vacated[occupation] = True
        units = self._units
        for key, index in self._successors.get((unit.spec.key, occupation), ()):
            later = units[key]
            later.blocked[index] -= 1
            if copied is not None:
                later.copy_waits[index].append(copied)

    def _saved(self, unit: _Unit, copied: Any, swapped: bool) -> None:
        """A save left the unit's bytes (caller holds the condition); ``swapped``: loadable now."""
        unit.region.close()
        unit.copied = copied
        unit.vacated_event[0] = copied
        if swapped:
            self._set_state(unit, LayerState.SWAPPED)
        self._vacate(unit, 0, copied)

    def _save_inline(self, unit: _Unit) -> None:
        """The pinned tier: the executor queues the unit's copy to the host and moves on (no disk, no thread)."""
        records, span, file_offset = self._records(unit)
        copied = self._transfer.save(self.storage, records, span, file_offset, unit.event, self._generation)
        with self._cond:  # no IO thread's time: the few µs of queuing are the executor's, inside the step
            self._set_state(unit, LayerState.WAIT_FOR_OFF)
            self._saved(unit, copied, True)

    def _issue_loads(self) -> None:
        """The pinned tier: queue the copies back of every unit, in load order, whose lookahead has come
        and whose bytes are free (the loader thread's conditions, checked by the executor at each step)."""
        order = self._load_order
        while self._issue_cursor < len(order):
            unit = order[self._issue_cursor]
            lookahead_from = unit.plan.load_at - max(self._plan.window, self._lead.get(unit.spec.key, 0))
            if not (self._t >= lookahead_from and unit.state is LayerState.SWAPPED and self._room_free(unit, 1)):
                return
            self._load_unit(unit, self._generation)
            self._issue_cursor += 1

    def _room_free(self, unit: _Unit, occupation: int) -> bool:
        """Every earlier occupant of the unit's bytes for this occupation has left them: the units (``blocked``), and
        with a shared arena the step tensors (the executor is past their last moment: ``SharedLayout.gates``)."""
        return unit.blocked[occupation] == 0 and self._t > self._gates.get((unit.spec.key, occupation), -1)

    def _wait_for(self, predicate: Callable[[], bool]) -> float:
        """Wait (holding the condition) until ``predicate``; returns the seconds waited."""
        if predicate():
            return 0.0
        if self._inline:  # no IO thread works for this step: nobody else would ever make it true
            raise OffloadError("the offload schedule waits for arena bytes that no save or load will free "
                               "(the plan is inconsistent with the step)")
        started = time.perf_counter()
        self._executor_waiting = True
        try:
            while not predicate():
                if self._error is not None:
                    break
                if self._closed:
                    raise OffloadError("the offload scheduler was closed")
                if not self._cond.wait(timeout=1.0):
                    self.wait_timeouts += 1
        finally:
            self._executor_waiting = False
        self._raise_if_failed()
        return time.perf_counter() - started

    def _wake(self) -> None:
        """Notify the waiters (caller holds the condition) if a wait may have ended: the executor's
        (any change may be what it waits for) or the loader's (its own condition now holds).

        Measured (``engine bench --model resnet18 --batch-size 32 --offload-n 4``, three alternating
        runs each): step ratio median 1.103 -> 1.091, within this machine's noise. A release still
        costs the executor ~50 µs (was ~80): most of that is waiting for the GIL, not the wake-up.
        """
        ready = self._loader_ready
        if self._executor_waiting or (ready is not None and ready()):
            self._cond.notify_all()

    def _wait_io_idle(self) -> None:
        with self._cond:
            self._wait_for(lambda: self._saves_pending == 0 and self._load_jobs_pending == 0)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, OffloadError):
                raise error
            if isinstance(error, UserError):  # a named disk fault (no space, checksum mismatch): its own words
                raise OffloadDiskFault(str(error)) from error
            if isinstance(error, OSError):  # EIO and friends from the IO thread: the user's disk, not a bug
                raise OffloadDiskFault(
                    f"the swap file's disk failed during a step ({error.strerror or error}); check the disk "
                    f"or choose another --offload-dir"
                ) from error
            raise OffloadError(f"offload IO failed: {error}") from error

    def _set_state(self, unit: _Unit, state: LayerState) -> None:
        """Change a unit's state (caller holds the condition) and keep the resident counters."""
        old = unit.state
        if old is state:
            return
        nbytes = unit.plan.nbytes
        if old in RESIDENT:
            self._resident_bytes -= nbytes
            self._resident_units -= 1
        if old in IN_FLIGHT:
            self._in_flight_bytes -= nbytes
        if old is LayerState.SWAPPED:
            self._swapped_bytes -= nbytes
        unit.state = state
        if state in RESIDENT:
            self._resident_bytes += nbytes
            self._resident_units += 1
        if state in IN_FLIGHT:
            self._in_flight_bytes += nbytes
        if state is LayerState.SWAPPED:
            self._swapped_bytes += nbytes
        stats = self._current
        if stats is not None:
            stats.peak_resident_bytes = max(stats.peak_resident_bytes, self._resident_bytes)
            stats.peak_resident_units = max(stats.peak_resident_units, self._resident_units)
            stats.peak_in_flight_bytes = max(stats.peak_in_flight_bytes, self._in_flight_bytes)
            stats.peak_swapped_bytes = max(stats.peak_swapped_bytes, self._swapped_bytes)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d t=%d layer %s: %s -> %s", len(self.stats), self._t, unit.spec.label, old.name,
                      state.name)
        self._wake()

    # -- IO threads ------------------------------------------------------------------------------

    def _records(self, unit: _Unit) -> tuple[list[SwapRecord], Any, int]:
        """The unit's records, its whole span in the arena (page aligned) and its offset in the file."""
        plan = unit.plan
        records = [SwapRecord(plan.file_offset + t.offset, t.nbytes, unit.spec.name, t.name) for t in unit.spec.tensors]
        span = self._arena[plan.arena_offset:plan.arena_offset + plan.nbytes]
        return records, span, plan.file_offset

    def _saver_loop(self) -> None:
        """Saves in order. On the cpu backend a save is its write (the arena's bytes go to disk). On a
        GPU with the swap file, a save queues its copy to one of the staging ring's pinned buffers and
        frees the unit's device bytes at once; the writes follow in order. The oldest is written when
        the ring is full, or when its copy has run and no save is queued: until its copy has run (the
        GPU runs behind the host, up to a step) the saver keeps taking new saves, polling the copy
        every millisecond, so the executor's room waits do not queue behind the GPU or the disk."""
        staged: collections.deque = collections.deque()  # saves copied (or copying) off the device, not written
        while True:
            if staged:
                copied = self._transfer.copy_done(staged[0][-1])
                if len(staged) >= self._transfer.save_ring or (copied and self._save_queue.empty()):
                    self._finish_save(*staged.popleft())
                    continue
                try:
                    item = self._save_queue.get(timeout=None if copied else 0.001)
                except queue.Empty:
                    continue
            else:
                item = self._save_queue.get()
            if item is None:
                while staged:
                    self._finish_save(*staged.popleft())
                return
            generation, unit = item
            written = True
            try:
                if generation == self._generation and self._error is None:
                    records, span, file_offset = self._records(unit)
                    started, cpu_started = time.perf_counter(), time.thread_time()
                    storage = self.storage
                    copied = self._transfer.save(storage, records, span, file_offset, unit.event, generation)
                    swapped = self._transfer.swapped_when_saved(storage)
                    with self._cond:
                        self._io_busy["saver"] += time.perf_counter() - started
                        self._io_busy["saver_cpu"] += time.thread_time() - cpu_started
                        if generation == self._generation:  # the bytes are free: the copy is queued (device)
                            self._saved(unit, copied, swapped)
                    if not swapped:  # the disk tier: written later, by _finish_save
                        staged.append((generation, unit, storage, records, span.nbytes, file_offset, copied))
                        written = False
            except BaseException as exc:  # handed to the executor at its next wait
                with self._cond:
                    self._error = exc
            finally:
                if written:
                    with self._cond:
                        self._saves_pending -= 1
                        self._cond.notify_all()

    def _finish_save(self, generation: int, unit: _Unit, storage: Any, records: list[SwapRecord], nbytes: int,
                     file_offset: int, copied: Any) -> None:
        """The disk tier: wait for the unit's copy off the device (the write reads its bytes), write it."""
        try:
            started, cpu_started = time.perf_counter(), time.thread_time()
            self._transfer.finish_save(storage, records, nbytes, file_offset, copied, generation)
            with self._cond:
                self._io_busy["saver"] += time.perf_counter() - started
                self._io_busy["saver_cpu"] += time.thread_time() - cpu_started
                if generation == self._generation:
                    self._set_state(unit, LayerState.SWAPPED)
        except BaseException as exc:
            with self._cond:
                self._error = exc
        finally:
            with self._cond:
                self._saves_pending -= 1
                self._cond.notify_all()

    def _loader_loop(self) -> None:
        while True:
            item = self._load_queue.get()
            if item is None:
                return
            generation, order = item
            try:
                for unit in order:
                    lookahead_from = unit.plan.load_at - max(self._plan.window, self._lead.get(unit.spec.key, 0))

                    def ready(unit: _Unit = unit, lookahead_from: int = lookahead_from,
                              generation: int = generation) -> bool:
                        return (generation != self._generation or self._error is not None or self._closed or (
                            self._t >= lookahead_from and unit.state is LayerState.SWAPPED
                            and self._room_free(unit, 1)))

                    with self._cond:
                        while not ready():
                            self._loader_ready = ready
                            try:
                                if not self._cond.wait(timeout=1.0):
                                    self.wait_timeouts += 1
                            finally:
                                self._loader_ready = None
                        if generation != self._generation or self._error is not None or self._closed:
                            break
                    self._load_unit(unit, generation)
            except BaseException as exc:
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
            finally:
                with self._cond:
                    self._load_jobs_pending -= 1
                    self._cond.notify_all()

    def _load_unit(self, unit: _Unit, generation: int) -> None:
        """Bring the unit back into its bytes (its time and room have come): the loader thread, or the
        executor with the pinned tier. The copy waits for the kernels that last read the bytes and for
        the unit's own save copy (device events; None on the cpu backend)."""
        with self._cond:
            self._set_state(unit, LayerState.WAIT_FOR_EXEC)
            vacated = [self._units[key].vacated_event[index]
                       for key, index in self._placed.predecessors[(unit.spec.key, 1)]]
        if unit.copied is not None:
            vacated.append(unit.copied)
        records, span, file_offset = self._records(unit)
        started, cpu_started = time.perf_counter(), time.thread_time()
        event = self._transfer.load(self.storage, records, span, file_offset, generation,
                                    after=[e for e in vacated if e is not None])
        with self._cond:
            if not self._inline:  # the loader thread's time (inline: the executor's, inside the step)
                self._io_busy["loader"] += time.perf_counter() - started
                self._io_busy["loader_cpu"] += time.thread_time() - cpu_started
            unit.event = event
            unit.region.open(generation)
            self._set_state(unit, LayerState.READY_FOR_EXEC)


def offload_summary(plan: OffloadPlan, no_offload_bytes: int | None = None, file_bytes: int | None = None,
                    swap_kind: str = "swap file") -> str:
    """One line for logs and the CLI: the planned resident peak with offload against the one without.

    ``no_offload_bytes``: what training without offload holds of the same tensors (the planned arena,
    ``engine.offload.session.offloadable_resident_bytes``); without it, all of them kept at once.
    ``file_bytes``: the swap file allocated (default: the part of it the plan writes); ``swap_kind``: the
    storage's ``kind`` (a GPU run whose swapped bytes fit the host budget swaps to pinned host memory).
    The arena is what the plan reserves: each unit's span starts where its load may begin, so the bytes
    actually resident at once (the summary's measured peak) can be smaller. ``lower_bound_bytes`` is a
    bound on the arena (the most the reserved spans overlap), not on the resident bytes: it is named so.
    """
    baseline = plan.total_bytes if no_offload_bytes is None else no_offload_bytes
    return (f"window {plan.window}: saved-for-backward arena {format_bytes(plan.arena_bytes)} planned "
            f"(its reserved spans overlap by at most {format_bytes(plan.lower_bound_bytes)}), "
            f"without offload {format_bytes(baseline)}; "
            f"{len(plan.offloaded)} of {len(plan.units)} units written"
            + (f" ({len(plan.kept)} kept by the budget, {format_bytes(plan.kept_bytes)})" if plan.kept else "")
            + f", {swap_kind} {format_bytes(plan.file_bytes_used if file_bytes is None else file_bytes)}")


__all__ = ["LayerState", "OffloadError", "OffloadScheduler", "StepStats", "cpu_per_mib", "offload_summary"]
