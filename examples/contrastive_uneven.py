"""A CLIP-style contrastive loss under DDP whose batch size differs on every rank, with exact gradients.

    torchrun --standalone --nproc-per-node 2 examples/contrastive_uneven.py
    torchrun --standalone --nproc-per-node 3 examples/contrastive_uneven.py

A contrastive (InfoNCE / CLIP) loss needs every rank's embeddings: each sample's negatives are all the other
samples of the *global* batch. The gather must therefore carry gradients back to the rank that computed each
embedding, and it must accept a different number of rows on every rank: the last batch of an epoch with
``drop_last=False``, a sampler that splits unevenly, a filter that drops samples. Here rank ``r`` has a different
batch size at every step, one rank now and then none at all.

``torchmetrics_gradpatch.gather_all_tensors(x, mode="global")`` is that gather: the values are those of
``torch.distributed.all_gather`` (bit for bit), and its backward sends each rank the sum of every rank's gradient
for its rows. Every rank computes the same global-batch loss from the gathered embeddings, so after DDP averages
the ranks' gradients the model receives exactly the single-process gradient of the global-batch loss. The script
checks that at every step, in float64, to 1e-12 relative, against the same loss computed in one process on the
concatenated global batch, and exits non-zero if any step differs.

It also shows, in one line labelled ``torch.distributed.nn.functional.all_gather``, what the usual autograd-aware
all_gather does with the same uneven shapes. It allocates every rank's output with the *caller's* shape, so it
cannot gather rows it does not know about. On gloo the collective fails: the line says ``REFUSED`` and which
rank raised what (``RuntimeError: Connection closed by peer`` with torch 2.13), or a rank's process aborts; other
backends may return wrongly shaped data (``MIS-GATHERED``). The attempt runs in separate throwaway processes,
with their own group, because a failed or aborted process cannot be recovered.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import re
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel

import torchmetrics_gradpatch
from torchmetrics_gradpatch import gather_all_tensors

STEPS = 6
IMAGE_FEATURES, TEXT_FEATURES, EMBEDDING = 6, 5, 4
DTYPE = torch.float64  # so "equal" can mean equal up to rounding (1e-12), not up to float32 noise
TOLERANCE = 1e-12
TORCH_TIMEOUT = 120.0  # seconds the torch all_gather demonstration may take before its ranks are ended


def rows(step: int, rank: int) -> int:
    """Rank ``rank``'s batch size at ``step``: different on every rank, sometimes zero (never on every rank)."""
    return (3 + 2 * rank + step) % 5


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s paired (image, text) features at ``step`` (any process can rebuild it)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    n = rows(step, rank)
    image = torch.randn(n, IMAGE_FEATURES, generator=generator, dtype=DTYPE)
    text = image[:, :TEXT_FEATURES] + 0.3 * torch.randn(n, TEXT_FEATURES, generator=generator, dtype=DTYPE)
    return image, text


class DualEncoder(torch.nn.Module):
    """Two linear encoders to a shared, normalised embedding space, and a learnable temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.image = torch.nn.Linear(IMAGE_FEATURES, EMBEDDING, dtype=DTYPE)
        self.text = torch.nn.Linear(TEXT_FEATURES, EMBEDDING, dtype=DTYPE)
        self.log_scale = torch.nn.Parameter(torch.tensor(2.0, dtype=DTYPE))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1)


def clip_loss(image: torch.Tensor, text: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE over a whole batch: sample ``i``'s positive is pair ``i``, every other sample a negative."""
    logits = log_scale.exp() * image @ text.t()
    labels = torch.arange(image.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def single_process_gradient(model: DualEncoder, step: int, world_size: int) -> list[torch.Tensor]:
    """Gradient of the global-batch loss over every rank's samples, in this process alone, without any gather."""
    reference = copy.deepcopy(model)
    images, texts = zip(*(batch(step, rank) for rank in range(world_size)), strict=True)
    image, text = reference(torch.cat(images), torch.cat(texts))
    return list(torch.autograd.grad(clip_loss(image, text, reference.log_scale), list(reference.parameters())))


def _torch_all_gather_rank(rank: int, world_size: int, port: int, step: int, results: Any) -> None:
    """One throwaway rank: join a gloo group on loopback, try torch's autograd all_gather on this step's batch."""
    import torch.distributed.nn.functional as tdnn

    warnings.simplefilter("ignore", FutureWarning)  # it is deprecated on recent torch
    # The same deadline inside: a rank whose parent is gone gives up by itself instead of waiting forever.
    limit = datetime.timedelta(seconds=TORCH_TIMEOUT)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=limit)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=limit)
        dist.barrier()  # gloo may return from init on one rank while a peer still connects
        image, _ = batch(step, rank)
        shapes = [tuple(t.shape) for t in tdnn.all_gather(image.requires_grad_())]
    except Exception as err:
        results.put((rank, None, f"{type(err).__name__}: {err}"))
        return  # the group may be broken: the parent ends this process
    results.put((rank, shapes, None))
    dist.destroy_process_group()


def torch_all_gather_verdict(step: int, world_size: int) -> str:
    """What ``torch.distributed.nn.functional.all_gather`` does with step ``step``'s uneven batches."""
    sizes = [rows(step, rank) for rank in range(world_size)]
    # Hosted here on a port the kernel picks (0) and kept open, so no other job can take it before the ranks join.
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
    results = mp.get_context("spawn").SimpleQueue()
    args = (world_size, store.port, step, results)
    ranks = mp.start_processes(_torch_all_gather_rank, args, world_size, join=False, start_method="spawn")
    shapes: dict[int, Any] = {}
    deadline = time.monotonic() + TORCH_TIMEOUT
    try:
        while len(shapes) < world_size:
            exited = {rank for rank, proc in enumerate(ranks.processes) if proc.exitcode is not None}
            while not results.empty():  # after reading the exits: whatever an exited rank sent is here now
                rank, gathered, error = results.get()
                if error is not None:
                    reason = f"rank {rank} raised: {_first_sentence(error)}"
                    return f"rows per rank {sizes}: REFUSED, as expected (it needs equal shapes): {reason}"
                shapes[rank] = gathered
            died = sorted(exited - shapes.keys())
            if died:  # gloo can abort a process instead of raising
                code = ranks.processes[died[0]].exitcode or 0
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                reason = f"rank {died[0]} died ({how}) without returning"
                return f"rows per rank {sizes}: REFUSED, as expected (it needs equal shapes): {reason}"
            if time.monotonic() > deadline:
                pending = sorted(set(range(world_size)) - shapes.keys())
                return f"rows per rank {sizes}: TIMED OUT after {TORCH_TIMEOUT:.0f} s, ranks {pending} terminated"
            time.sleep(0.1)
    finally:  # every path: no rank outlives this call
        for proc in ranks.processes:
            proc.terminate()
        for proc in ranks.processes:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    ordered = [shapes[rank] for rank in range(world_size)]
    wrong = [s for s in ordered if [shape[0] for shape in s] != sizes]
    return f"rows per rank {sizes}: {'MIS-GATHERED' if wrong else 'gathered'}, returned shapes {ordered}"


def _first_sentence(details: str) -> str:
    """The first sentence of the error's last line, without gloo's source path and the peer's address (which
    changes every run): the message itself, not gloo's advice that follows it."""
    lines = details.strip().splitlines() or ["(no message)"]
    last = re.sub(r"\[/[^\]]*\] ", "", lines[-1])
    last = re.sub(r" \[[0-9.:a-f]+\]:\d+", "", last)
    return last.split(". ", 1)[0].rstrip(".")


def main(show_torch: bool) -> int:
    world_size = int(os.environ["WORLD_SIZE"])
    if int(os.environ["RANK"]) == 0 and show_torch:
        # Before this job's group exists, in separate processes: an aborted gloo process cannot be recovered.
        verdict = torch_all_gather_verdict(0, world_size)
        print(
            f"torch.distributed.nn.functional.all_gather on the same uneven batches, in throwaway processes: {verdict}"
        )
        print(
            "(expected: the limitation that gather_all_tensors(x, mode='global') removes; this example's run follows)"
        )
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *args, **kwargs: None)

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = DualEncoder()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    status = torchmetrics_gradpatch.status()
    say(f"world size {world_size}, torch {torch.__version__}, torchmetrics {status.torchmetrics_version}")
    say("checking: DDP gradient == single-process gradient of the global-batch CLIP loss, at every step")

    worst = 0.0
    for step in range(STEPS):
        image, text = batch(step, rank)
        optimizer.zero_grad()
        image_emb, text_emb = ddp(image, text)
        # The differentiable all-gather for uneven shapes: every rank gets every rank's rows, with gradients.
        all_image = torch.cat(gather_all_tensors(image_emb, mode="global"))
        all_text = torch.cat(gather_all_tensors(text_emb, mode="global"))
        loss = clip_loss(all_image, all_text, model.log_scale)  # the global-batch loss, the same on every rank
        expected = single_process_gradient(model, step, world_size)  # before the optimizer changes the model
        loss.backward()  # global-mode gathers send gradients home; DDP averages
        got = [p.grad for p in model.parameters()]
        error = max(
            float((g - e).abs().max()) / max(float(e.abs().max()), 1e-300)
            for g, e in zip(got, expected, strict=True)
            if g is not None
        )
        worst = max(worst, error)
        sizes = [rows(step, r) for r in range(world_size)]
        say(f"step {step}  rows per rank {sizes}  loss {loss.item():.6f}  relative gradient error {error:.1e}")
        optimizer.step()

    ok = worst <= TOLERANCE
    say(f"gradient: {'OK' if ok else 'MISMATCH'} (worst relative difference {worst:.1e} over {STEPS} steps)")
    # Let DDP and the last graph (and the gloo work they hold) go before the group does.
    del ddp, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--no-torch-all-gather", action="store_true", help="skip the torch.distributed.nn.functional.all_gather line"
    )
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit(f"run me with torchrun: torchrun --standalone --nproc-per-node 2 {sys.argv[0]}")
    sys.exit(main(not args.no_torch_all_gather))
