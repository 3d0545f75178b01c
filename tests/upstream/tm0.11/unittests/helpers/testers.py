# Copyright The PyTorch Lightning team.
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
import os
import sys
from typing import Optional

import torch
from torch import tensor
from torch.multiprocessing import set_start_method

from torchmetrics import Metric

try:
    set_start_method("spawn")
except RuntimeError:
    pass

NUM_PROCESSES = 2
NUM_BATCHES = 4  # Need to be divisible with the number of processes
BATCH_SIZE = 32
# NUM_BATCHES = 10 if torch.cuda.is_available() else 4
# BATCH_SIZE = 64 if torch.cuda.is_available() else 32
NUM_CLASSES = 5
EXTRA_DIM = 3
THRESHOLD = 0.5

# torchmetrics_gradpatch: tests/upstream/run.py names a free port block per run; upstream's fixed 8088-8100
# collide when two runs share a machine (tox -p runs the fused environments side by side)
START_PORT = int(os.environ.get("TMGP_UPSTREAM_START_PORT", "8088"))
MAX_PORT = START_PORT + 12
CURRENT_PORT = START_PORT


def setup_ddp(rank, world_size):
    """Setup ddp environment."""
    global CURRENT_PORT

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(CURRENT_PORT)

    CURRENT_PORT += 1
    if CURRENT_PORT > MAX_PORT:
        CURRENT_PORT = START_PORT

    if torch.distributed.is_available() and sys.platform not in ("win32", "cygwin"):
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


class DummyMetric(Metric):
    name = "Dummy"
    full_state_update: Optional[bool] = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("x", tensor(0.0), dist_reduce_fx="sum")

    def update(self):
        pass

    def compute(self):
        pass


class DummyListMetric(Metric):
    name = "DummyList"
    full_state_update: Optional[bool] = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("x", [], dist_reduce_fx="cat")

    def update(self, x=torch.tensor(1)):
        self.x.append(x)

    def compute(self):
        return self.x


class DummyMetricSum(DummyMetric):
    def update(self, x):
        self.x += x

    def compute(self):
        return self.x
