# Copyright The Lightning team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# Trimmed for torchmetrics_gradpatch (tests/upstream/README.md): only what bases/test_ddp.py uses is kept, as upstream wrote it.
from typing import Any, Optional

import torch
from torch import tensor
from torchmetrics import Metric


class DummyMetric(Metric):
    """DummyMetric for testing core components."""

    name = "Dummy"
    full_state_update: Optional[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("x", tensor(0.0), dist_reduce_fx="sum")

    def update(self):
        """Update state."""

    def compute(self):
        """Compute value."""


class DummyListMetric(Metric):
    """DummyListMetric for testing core components."""

    name = "DummyList"
    full_state_update: Optional[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("x", [], dist_reduce_fx="cat")

    def update(self, x=None):
        """Update state."""
        x = torch.tensor(1) if x is None else x
        self.x.append(x)

    def compute(self):
        """Compute value."""
        return self.x


class DummyMetricSum(DummyMetric):
    """DummyMetricSum for testing core components."""

    def update(self, x):
        """Update state."""
        self.x += x

    def compute(self):
        """Compute value."""
        return self.x
