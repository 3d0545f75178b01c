"""``examples/contrastive_uneven.py`` runs through torchrun on 2 and 3 ranks, as its docstring says.

The example checks at every step that the DDP gradient of a CLIP-style loss over uneven per-rank batches,
gathered with ``gather_all_tensors(x, mode="global")``, equals the single-process gradient of the global-batch
loss (float64, 1e-12), and exits non-zero otherwise; it also reports what
``torch.distributed.nn.functional.all_gather`` does with the same shapes.
"""

from __future__ import annotations

import re

import pytest

from tests._torchrun import NEEDS_TORCH_2, show, torchrun

pytestmark = [NEEDS_TORCH_2, pytest.mark.system]

EXAMPLE = "examples/contrastive_uneven.py"


@pytest.mark.parametrize("world_size", [2, 3])
def test_contrastive_example_gradient_is_the_single_process_gradient(world_size: int) -> None:
    proc = torchrun(EXAMPLE, nproc=world_size)
    assert proc.returncode == 0, show(proc)
    steps = re.findall(r"^step (\d+)  rows per rank \[([\d, ]+)\].*relative gradient error (\S+)$", proc.stdout, re.M)
    assert len(steps) == 6, show(proc)
    sizes = [[int(n) for n in rows.split(",")] for _, rows, _ in steps]
    assert all(len(s) == world_size for s in sizes)
    assert any(len(set(s)) == world_size for s in sizes), "the batches must be uneven"
    assert any(0 in s for s in sizes), "some step must have a rank without rows"
    assert all(float(error) <= 1e-12 for _, _, error in steps), show(proc)
    assert "gradient: OK" in proc.stdout, show(proc)
    # torch's own all-gather on the same shapes: an expected, labelled refusal (or wrong shapes), whole, not a crash
    lines = proc.stdout.splitlines()
    (line,) = [x for x in lines if x.startswith("torch.distributed.nn.functional.all_gather")]
    assert "REFUSED, as expected (it needs equal shapes)" in line or "MIS-GATHERED" in line, line
    assert "GLHF" not in line and "/pytorch/" not in line, line  # gloo's advice and source path are dropped
    assert lines[lines.index(line) + 1].startswith("(expected: the limitation that gather_all_tensors"), show(proc)
