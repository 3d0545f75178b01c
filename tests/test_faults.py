"""Faults of the caller's making that need no ranks: an uninitialised process group, a non-tensor input.

Each must raise exactly the error the unpatched torchmetrics gather raises, patched in every mode that installs
code here, and through the package's own gather in either mode. No process group is made: the pytest process has
none, which is the fault under test. (In an initialised group the same comparison runs in test_properties.py.)
"""

from __future__ import annotations

import pytest
import torch

import torchmetrics_gradpatch as tmgp
from tests._rank_tools import error_of, errors_off_and_on


@pytest.mark.parametrize(
    "tensor", [torch.tensor(1.0), torch.ones(3), torch.ones(2, 0)], ids=["scalar", "vector", "empty"]
)
def test_uninitialised_process_group_gives_the_unpatched_error(tensor: torch.Tensor) -> None:
    from torchmetrics.utilities.distributed import gather_all_tensors

    assert not torch.distributed.is_initialized()
    tensor.requires_grad_(tensor.is_floating_point())
    unpatched, *patched = errors_off_and_on(lambda: gather_all_tensors(tensor))
    assert unpatched[0] is not None and patched and all(error == unpatched for error in patched)
    # the package's own gather, called directly, raises the same too, in either mode
    for mode in ("local", "global"):
        assert error_of(lambda: tmgp.gather_all_tensors(tensor, mode=mode)) == unpatched  # noqa: B023


@pytest.mark.parametrize("value", [1.5, [1.0, 2.0], None, "x", (torch.ones(1),)], ids=repr)
def test_non_tensor_gives_the_unpatched_error(value: object) -> None:
    from torchmetrics.utilities.distributed import gather_all_tensors

    unpatched, *patched = errors_off_and_on(lambda: gather_all_tensors(value))
    assert unpatched[0] is not None and patched and all(error == unpatched for error in patched)
