"""Where the fused sync steps aside: now in :mod:`.recognise`; these names stay until their callers read them there."""

from torchmetrics_gradpatch.fused.recognise import COMPUTE, PARTS, SINGLE, STEP, aside, forget, stepping_aside

__all__ = ["COMPUTE", "PARTS", "SINGLE", "STEP", "aside", "forget", "stepping_aside"]
