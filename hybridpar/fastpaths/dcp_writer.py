"""DCP's file writer without the zip CRC-32 that torch.save computes for every tensor (a fast path).

No reader checks those CRCs (neither torch.load nor DCP's readers nor hybridpar's), and computing
them is a large part of a save's CPU time. Truncation and damaged headers are still caught by the
reader. The files differ from the stock writer's only in the CRC fields left at zero.
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

from ..compat.torch import save_without_crc32


class UncheckedWriter(dcp.FileSystemWriter):
    """dcp.FileSystemWriter minus the CRC-32s, skipped only while this writer writes. torch applies the
    setting on the calling thread alone: files that DCP's other writer threads write keep their CRCs."""

    def write_data(self, plan, planner):
        with save_without_crc32():
            return super().write_data(plan, planner)
